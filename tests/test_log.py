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
