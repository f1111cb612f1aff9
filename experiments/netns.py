"""A bandwidth-limited link between two "nodes": network namespaces, a veth pair, ``tc`` token bucket.

Why: per step a rank does about F*T FLOPs for its T tokens and moves bytes in
proportion to the parameters, so the communication share of a step scales
like (FLOP/s) / (bandwidth * T). One CPU core against loopback TCP is about
20-100 FLOP per byte; 8 H100s over NVLink are about 1000-2000. On plain
loopback every sharding strategy looks alike, so the experiments also run the
ranks in two network namespaces joined by a veth pair whose egress, on both
ends, is shaped with ``tc qdisc ... tbf rate R``, R chosen so that this
machine's per-core FLOP/s divided by R is the GPU node's ratio
(``rate_for_ratio``).

Each namespace is a node and holds one rank or several (one torchrun per
namespace starts them; ``run.launch``). Every rank binds its namespace's veth
address (``GLOO_SOCKET_IFNAME``). Two ranks of one namespace then talk
between two local addresses, which the kernel routes over that namespace's
loopback (its ``local`` routing table: ``route_device``), unshaped, as GPUs in
a node talk over NVLink; ranks of different namespaces talk through the veth,
shaped, as nodes talk over their NICs. The tbf shapes a namespace's egress as
a whole: its ranks share the rate as a node's GPUs share its NICs.

Everything here is private to the run: two namespaces named
``osdpx<pid>r<n>a`` / ``...b`` (unique per process and link), the veth ends
``osdpl`` created directly inside them (nothing appears in the host's
namespace), the test addresses 10.77.0.1/24 and 10.77.0.2/24 on them, and
traffic only between the two. ``VethLink`` removes both namespaces (which
removes the veth pair and its qdiscs) on exit, on an exception, at interpreter
exit (atexit) and on SIGINT/SIGTERM/SIGHUP; ``cleanup_stale()`` removes
namespaces left by a process that was killed with SIGKILL.

Needs root and iproute2 (``ip``, ``tc``) with the kernel's veth and tbf
(``sch_tbf``) support. On Debian/Ubuntu: ``apt-get install -y iproute2``.
(``netem`` is not needed: some kernels, this machine's included, lack it.)
"""

from __future__ import annotations

import atexit
import itertools
import os
import re
import shutil
import signal
import subprocess
import threading
from dataclasses import dataclass, field
from typing import Callable

PREFIX = "osdpx"  # every namespace this module makes starts with it
IFNAME = "osdpl"  # the veth end inside each namespace
SUBNET = "10.77.0"  # private test addresses, only inside our own namespaces
_counter = itertools.count()
_live: dict[str, "VethLink"] = {}
_lock = threading.Lock()
_handlers_installed = False


class NetnsUnavailable(RuntimeError):
    """This machine cannot make the link (not root, no iproute2, no veth or tbf in the kernel)."""


def missing_tools() -> str | None:
    """Why namespaces cannot be made here, or None if they can (checks root and the tools, not the kernel)."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' not found: install iproute2 (apt-get install -y iproute2)"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise NetnsUnavailable(f"'ip {' '.join(args)}' failed: {r.stderr.strip() or r.stdout.strip()}")
    return r


def list_namespaces() -> list[str]:
    r = _ip("netns", "list", check=False)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def _owner_pid(name: str) -> int | None:
    m = re.fullmatch(rf"{PREFIX}(\d+)r\d+[ab]", name)
    return int(m.group(1)) if m else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale() -> list[str]:
    """Delete namespaces of this module whose owning process is gone (after a SIGKILL); returns their names."""
    removed = []
    for name in list_namespaces():
        pid = _owner_pid(name)
        if pid is not None and pid != os.getpid() and not _alive(pid):
            _ip("netns", "del", name, check=False)
            removed.append(name)
    return removed


def rate_for_ratio(flops_per_s: float, flop_per_byte: float) -> int:
    """Link rate in bit/s that makes ``flops_per_s / (bytes/s) == flop_per_byte``."""
    return int(round(8 * flops_per_s / flop_per_byte))


_children: dict[int, subprocess.Popen] = {}  # processes started here, stopped on cleanup too


def spawn(cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    """Start ``cmd`` in its own session (so it and its children can be stopped together), output piped;
    stopped by the atexit and signal handlers if still running."""
    _install_handlers()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                         start_new_session=True)
    with _lock:
        _children[p.pid] = p
    return p


def _cleanup_all() -> None:
    """Stop the processes we started, then remove our namespaces (atexit, signals)."""
    with _lock:
        children = list(_children.values())
        links = list(_live.values())
    for p in children:
        stop(p)
    for link in links:
        link.close()


def _install_handlers() -> None:
    """atexit and signal handlers that remove every live link (chaining to the previous handlers)."""
    global _handlers_installed
    if _handlers_installed:
        return
    _handlers_installed = True
    atexit.register(_cleanup_all)
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        previous = signal.getsignal(sig)

        def handler(signum, frame, previous=previous):
            _cleanup_all()
            if callable(previous):
                previous(signum, frame)
            elif previous == signal.SIG_IGN:
                return
            else:  # default action: die of the signal, as without us
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

        signal.signal(sig, handler)


@dataclass
class VethLink:
    """Two namespaces (nodes) joined by a veth pair, each end's egress shaped to ``rate_bit`` bit/s (None:
    unshaped); the rate is the node's, shared by the ranks in it.

    Use as a context manager; ``namespaces[i]`` and ``addresses[i]`` are node
    i's; ``exec_prefix(i)`` runs a command there (one rank, or a torchrun
    starting the node's ranks).
    """

    rate_bit: int | None
    burst_bytes: int | None = None
    latency_ms: float = 50.0
    namespaces: list[str] = field(default_factory=list)
    addresses: tuple[str, str] = (f"{SUBNET}.1", f"{SUBNET}.2")
    ifname: str = IFNAME
    _closed: bool = False

    def __enter__(self) -> "VethLink":
        why = missing_tools()
        if why:
            raise NetnsUnavailable(why)
        cleanup_stale()
        _install_handlers()
        n = next(_counter)
        self.namespaces = [f"{PREFIX}{os.getpid()}r{n}a", f"{PREFIX}{os.getpid()}r{n}b"]
        with _lock:
            _live[self.namespaces[0]] = self
        try:
            for ns in self.namespaces:
                _ip("netns", "add", ns)
            a, b = self.namespaces
            _ip("link", "add", self.ifname, "netns", a, "type", "veth", "peer", "name", self.ifname, "netns", b)
            for ns, addr in zip(self.namespaces, self.addresses):
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", self.ifname)
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "link", "set", self.ifname, "up")
                if self.rate_bit:
                    # burst: 1 ms at this rate, at least 32 KiB (measured: 32 KiB..1 MiB all give ~93% of the
                    # rate to one TCP stream here); small, so that a message is not sent at line rate
                    burst = self.burst_bytes or max(32 * 1024, self.rate_bit // 8 // 1000)
                    _ip("netns", "exec", ns, "tc", "qdisc", "add", "dev", self.ifname, "root", "tbf",
                        "rate", f"{self.rate_bit}bit", "burst", str(burst), "latency", f"{self.latency_ms}ms")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for ns in self.namespaces:
            _ip("netns", "del", ns, check=False)  # takes its veth end (and so the pair) and qdisc with it
        with _lock:
            if self.namespaces:
                _live.pop(self.namespaces[0], None)

    def exec_prefix(self, node: int) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[node]]

    def qdisc(self, node: int) -> str:
        r = _ip("netns", "exec", self.namespaces[node], "tc", "qdisc", "show", "dev", self.ifname, check=False)
        return r.stdout.strip()

    def route_device(self, node: int, address: str) -> str:
        """The interface node ``node`` sends to ``address`` through: ``lo`` for its own address (unshaped),
        the veth for the other node's (shaped)."""
        words = _ip("-n", self.namespaces[node], "route", "get", address).stdout.split()
        return words[words.index("dev") + 1]

    def describe(self) -> dict:
        return {
            "kind": "veth",
            "rate_bit_per_s": self.rate_bit,
            "qdisc": "tbf" if self.rate_bit else None,
            "namespaces": list(self.namespaces),
            "addresses": list(self.addresses),
            "ifname": self.ifname,
        }


def run_in_namespaces(link: VethLink, commands: list[list[str]], env: dict[str, str],
                      on_line: Callable[[int, str], None] | None = None,
                      timeout_s: float | None = None) -> list[int]:
    """Start ``commands[i]`` in node i's namespace (GLOO_SOCKET_IFNAME set), wait for all; their exit codes.

    If one fails, the others are terminated (then killed) so nothing waits
    forever on a dead peer. Output lines go to ``on_line(node, line)``.
    """
    procs = []
    try:
        for node, cmd in enumerate(commands):
            procs.append(spawn(link.exec_prefix(node) + cmd, {**env, "GLOO_SOCKET_IFNAME": link.ifname}))
        readers = []
        for node, p in enumerate(procs):
            def pump(node=node, p=p):
                for line in p.stdout:
                    if on_line:
                        on_line(node, line.rstrip("\n"))
            t = threading.Thread(target=pump, daemon=True)
            t.start()
            readers.append(t)
        return _wait_all(procs, timeout_s)
    finally:
        for p in procs:
            stop(p)


def _wait_all(procs: list[subprocess.Popen], timeout_s: float | None) -> list[int]:
    import time

    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return codes
        if any(c not in (None, 0) for c in codes):  # one died: give the others a moment, then stop them
            try:
                for p in procs:
                    p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            return [stop(p) for p in procs]
        if deadline is not None and time.monotonic() > deadline:
            return [stop(p) for p in procs]
        time.sleep(0.2)


def stop(p: subprocess.Popen) -> int:
    """Terminate one process we started (and its session), then kill it; its exit code."""
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
    with _lock:
        _children.pop(p.pid, None)
    return p.returncode


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="Check or clean up the experiment's network namespaces.")
    ap.add_argument("--cleanup-stale", action="store_true", help="remove namespaces left by killed runs")
    ap.add_argument("--check", action="store_true", help="make a shaped link, show its qdiscs, remove it")
    a = ap.parse_args()
    if a.cleanup_stale:
        print("removed:", cleanup_stale() or "nothing")
    if a.check:
        with VethLink(rate_bit=500_000_000) as link:
            print(link.describe())
            print(link.qdisc(0))
            print("node 0 reaches its own address over", link.route_device(0, link.addresses[0]),
                  "and node 1's over", link.route_device(0, link.addresses[1]))
        print("namespaces left:", [n for n in list_namespaces() if n.startswith(PREFIX)] or "none")
