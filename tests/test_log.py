"""osdp's progress log: a person reads one line per step of a task, not one per job of a loop."""

from osdp.log import Progress


def test_a_run_of_like_messages_shows_its_first_and_last_in_a_log(capsys):
    show = Progress("calibrate")
    for i in range(1, 21):
        show(f"setting up {i}/20 calibration-net{i}")
    show("step 1/17 of every job")
    show.done("done in 3 s")
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(" (")[0] for line in lines] == [
        "osdp calibrate: setting up 1/20 calibration-net1",
        "osdp calibrate: setting up 20/20 calibration-net20",  # the run's last, where the next kind begins
        "osdp calibrate: step 1/17 of every job",
        "osdp calibrate: done in 3 s",
    ]


def test_silenced_progress_prints_nothing(capsys):
    show = Progress("describe x", enabled=False)
    show("warm-up")
    show.done("done")
    assert capsys.readouterr().err == ""


def test_quiet_silences_every_progress_line(capsys, monkeypatch):
    from osdp.log import QUIET_ENV, log

    monkeypatch.setenv(QUIET_ENV, "1")
    show = Progress("describe x")
    show("warm-up")
    show.done("done")
    log("a note")
    assert capsys.readouterr().err == ""


def test_a_task_told_its_fraction_done_says_how_long_is_left(capsys, monkeypatch):
    import osdp.log

    clock = iter([0.0, 1.0, 3.0, 5.0, 11.0])  # the start, then each message's moment
    monkeypatch.setattr(osdp.log.time, "perf_counter", lambda: next(clock))
    show = Progress("calibrate")
    show("collectives", 0.0)  # no pace yet
    show("compute", 0.1)  # 2 s for a tenth: 18 s left
    show("describing the nets", 0.4)  # 4 s for 0.4: 6 s left
    show.done("done in 11 s")
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "osdp calibrate: collectives (1.0s)",
        "osdp calibrate: compute (3.0s, about 18s left)",
        "osdp calibrate: describing the nets (5.0s, about 6s left)",
        "osdp calibrate: done in 11 s (11.0s)",
    ]


def test_durations_read_as_a_person_reads_them():
    from osdp.log import format_seconds

    assert [format_seconds(s) for s in (0.4, 8.6, 59.4, 65, 3600)] == ["0s", "9s", "59s", "1m 05s", "60m 00s"]
