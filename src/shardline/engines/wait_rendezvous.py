"""Wait until the rendezvous host resolves, then exec the node's torchrun line.

On Kubernetes a pod can start before the DNS record of rank 0's pod exists (headless-Service and
JobSet hostnames appear only once that pod has an IP), and torchrun treats a failed lookup as fatal
(pytorch#73682, torchx#541). Every pod's command is therefore

    python -m shardline.engines.wait_rendezvous [--timeout S] [--chdir DIR] -- python -m shardline.engines.torchrun ...

which resolves `PET_MASTER_ADDR` (set by the manifest, or injected by Kubeflow Trainer) with backoff and
then replaces itself with the given command, so signals and the exit code are torchrun's own. `--chdir`
enters the shared storage first where the engine cannot set the container's working directory (a
TrainJob's runtime patches carry no `workingDir`); the Kubeflow SDK replaces this whole command with its own, and
its entry point enters the storage instead (engines/kubeflow_sdk.py).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time


def wait_for_host(host: str, timeout_s: float, log=print) -> bool:
    deadline = time.monotonic() + timeout_s
    delay, attempts = 0.5, 0
    while True:
        try:
            socket.getaddrinfo(host, None)
            if attempts:
                log(f"rendezvous host {host} resolves after {attempts} failed lookups")
            return True
        except socket.gaierror as e:
            attempts += 1
            if time.monotonic() + delay > deadline:
                log(f"rendezvous host {host} did not resolve within {timeout_s:.0f} s: {e}")
                return False
            if attempts == 1:
                log(f"waiting for rendezvous host {host} to resolve ({e})")
            time.sleep(delay)
            delay = min(delay * 2, 10.0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("usage: python -m shardline.engines.wait_rendezvous [--timeout S] [--chdir DIR] -- COMMAND...",
              file=sys.stderr)
        return 2
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="shardline.engines.wait_rendezvous")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the host to resolve")
    parser.add_argument("--chdir", help="directory to run the command in")
    args = parser.parse_args(argv[:split])
    command = argv[split + 1:]
    if args.chdir:
        os.chdir(args.chdir)
    host = os.environ.get("PET_MASTER_ADDR")
    if host and not wait_for_host(host, args.timeout, log=lambda m: print(f"[shardline] {m}", flush=True)):
        return 1
    os.execvp(command[0], command)
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
