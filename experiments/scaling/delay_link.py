"""The emulated cluster's wire with a one-way delay: a TUN device per node, packets held in user space.

Run by emulate.sh (as root) when DELAY is set, after the namespaces js0..js<N-1> exist:
    python experiments/scaling/delay_link.py --nodes 4 --delay-ms 5 --ready /tmp/ready

These kernels have no netem qdisc, so the delay cannot be a `tc` setting. Instead each namespace js<i> gets
a TUN device `jtun<i>` with address 10.200.0.<i+1>/24, its only route to the other nodes; this process
reads every IPv4 packet a node sends, holds it --delay-ms (`jaxscale.studies.link_emulation.run_delay_line`) and
writes it into the destination node's device, as if received. The rate limit stays in the kernel: tc tbf
on jtun<i>'s egress (bench_step.py / gloo_duplex.py install it), ahead of the delay. Writes --ready when
the devices are up; runs until SIGTERM/SIGINT, then prints its packet counts as one JSON line on stderr.
The devices vanish with this process (their fds are not persistent).
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import json
import os
import signal
import struct
import subprocess
import sys

from jaxscale.studies.link_emulation import run_delay_line

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
CLONE_NEWNET = 0x40000000
MTU = 1500


def _setns(path: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


def open_tun(namespace: str, name: str) -> int:
    """A TUN device `name` created inside network namespace `namespace`; returns its fd."""
    home = f"/proc/{os.getpid()}/ns/net"
    home_fd = os.open(home, os.O_RDONLY)
    try:
        _setns(f"/run/netns/{namespace}")
        try:
            fd = os.open("/dev/net/tun", os.O_RDWR)
            fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(), IFF_TUN | IFF_NO_PI))
        finally:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.setns(home_fd, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back to this process's namespace failed")
    finally:
        os.close(home_fd)
    os.set_blocking(fd, False)
    return fd


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--delay-ms", type=float, required=True)
    p.add_argument("--ready", required=True, help="file written once every device is up")
    a = p.parse_args(argv)
    fds = {}
    for i in range(a.nodes):
        ns, dev = f"js{i}", f"jtun{i}"
        fd = open_tun(ns, dev)
        for cmd in (["addr", "add", f"10.200.0.{i + 1}/24", "dev", dev], ["link", "set", dev, "mtu", str(MTU), "up"]):
            subprocess.run(["ip", "-n", ns, *cmd], check=True)
        fds[bytes([10, 200, 0, i + 1])] = fd
    stopping = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.append(True))
    with open(a.ready, "w") as f:
        f.write("up\n")
    counts = run_delay_line(fds, a.delay_ms / 1e3, stop=lambda: bool(stopping))
    print(json.dumps({"delay_link": counts, "delay_ms": a.delay_ms, "nodes": a.nodes}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
