"""The soak's kill lane: client processes (child.py) SIGKILLed in the middle of their work — streams
mid-upload, Calls mid-send, shared-memory and data-plane requests mid-transfer, sessions holding
memory, training streams that accumulate dW. The server must notice each and free what it held (the
soak checks fds, threads, sessions and regions at the end) and leave dW as it was before a killed
training request (checked here after each); the killed client's shared-memory objects, which it
could not unlink, are removed here."""
from __future__ import annotations

import glob
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import lce_client
from child import TRAIN_KILL_HEAD
from lanes import Lane

CHILD = Path(__file__).resolve().parent / "child.py"
MODES = ["stream", "call", "shm", "data_plane", "sessions", "train"]


class KillLane(Lane):
    name = "kills"

    def __init__(self, ctx, seed):
        super().__init__(ctx, seed)
        head = ctx.heads["default"]
        # A head of its own, which nothing else trains: its dW before a killed request is known.
        self.client = lce_client.Client(ctx.target, timeout=60)
        self.client.load_head(TRAIN_KILL_HEAD, seeded=(head.vocab, head.hidden, seed, "fp32"))

    def close(self) -> None:
        self.client.close()

    def step(self) -> None:
        mode = str(self.rng.choice(MODES))
        head = self.ctx.heads["default"]
        grad_before = self.client.get_grad(TRAIN_KILL_HEAD) if mode == "train" else None
        args = [sys.executable, str(CHILD), mode, self.ctx.target, str(head.hidden), str(head.vocab),
                str(int(self.rng.integers(1 << 30)))]
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            outcome = self._kill_when_ready(proc)
        finally:
            if proc.poll() is None:
                proc.kill()
            _, err = proc.communicate()
            for leftover in glob.glob(f"/dev/shm/lce-{proc.pid}-*"):
                os.unlink(leftover)
        if grad_before is not None and outcome == "killed":
            outcome = self._grad_outcome(grad_before)
        self.ledger.fault(f"sigkill/{mode}", outcome, {"killed", "killed, dW kept", "killed_unready"},
                          err.decode(errors="replace")[-400:])
        self.stop.wait(float(self.rng.uniform(0.5, 2.0)))

    def _grad_outcome(self, before: np.ndarray) -> str:
        """dW once the server has ended the killed request: back to `before`, bit for bit (it may take
        the server a moment to see the connection go and roll back)."""
        deadline = time.monotonic() + 20
        while True:
            after = self.client.get_grad(TRAIN_KILL_HEAD)
            if np.array_equal(before, after):
                return "killed, dW kept"
            if time.monotonic() > deadline:
                return "killed, dW changed"
            time.sleep(0.2)

    def _kill_when_ready(self, proc: subprocess.Popen) -> str:
        """Waits for the child's "ready" (its work under way), lets it work a random while, SIGKILLs it."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not self.stop.is_set():
            r, _, _ = select.select([proc.stdout], [], [], 0.5)
            if r:
                if proc.stdout.readline().strip() != b"ready":
                    return "exited_early"
                break
        else:
            return "never_ready" if not self.stop.is_set() else "killed_unready"
        time.sleep(float(self.rng.uniform(0.0, 0.6)))
        if proc.poll() is not None:
            return "exited_early"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        return "killed"
