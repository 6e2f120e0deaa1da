"""Kill a real ``deepdpm fit`` at every file-system step of writing its outputs.

Usage: ``python tests/support/fault_harness.py RESULTS [--no-exchange] -- FIT_ARGS...``

The fit runs as usual until it reaches :func:`pipeline.fit.outputs.write_fit_outputs`.
There a writer process takes over the writing of the outputs; at each of its
file-system steps (``os.replace``, ``os.rename``, ``os.link``, ``shutil.rmtree`` and the
folder exchange of :mod:`pipeline.io.run_folder`) it forks and sends itself ``SIGKILL``
just before the step. The harness records what the killed writer left (it copies the
folder that holds the output to ``RESULTS/k`` for the k-th step) and then lets the
writer's copy, which was waiting, do the step and go on to the next one. So the writer
is killed at every step in one pass. When a writer gets through every step, the harness
puts the folder back as it was and the fit writes its outputs itself and ends as usual.
``--no-exchange`` makes the publish take its two-rename path (systems without
``renameat2(RENAME_EXCHANGE)``).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import sys
from pathlib import Path

import pipeline.fit.outputs
import pipeline.io.run_folder
from pipeline.cli import main

#: (module, function) pairs whose every call is one step at which the writer is killed
STEPS = ((os, "replace"), (os, "rename"), (os, "link"), (shutil, "rmtree"),
         (pipeline.io.run_folder, "_exchange"))
#: prctl option: orphaned descendants are re-parented to this process (linux/prctl.h)
PR_SET_CHILD_SUBREAPER = 36


def _die_before_every_step(go: int) -> None:
    """Make each step fork this process and SIGKILL the parent; the child waits for a
    byte on the pipe ``go`` and then does the step."""
    for owner, name in STEPS:
        real = getattr(owner, name)

        def step(*args, _real=real, **kwargs):
            if os.fork() != 0:
                os.kill(os.getpid(), signal.SIGKILL)
            os.read(go, 1)  # until the harness has recorded what the kill left
            return _real(*args, **kwargs)

        setattr(owner, name, step)


def _series(results: Path, real_write):
    def write_with_kills(out_dir, model, table, *args, **kwargs):
        folder = Path(out_dir).resolve().parent
        # the writer is a fork of this process, whose torch thread pools do not survive a
        # fork (a matmul in the child waits forever): the writer's one computation, the
        # predictions, is made here and handed down
        predictions = model.predict_confidence(table.X)
        model.predict_confidence = lambda X: predictions
        saved = results / "before"
        shutil.copytree(folder, saved, symlinks=True)
        # the killed writers' copies become our children, so we can wait for them
        if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")
        go_read, go_write = os.pipe()
        if os.fork() == 0:
            os.close(go_write)
            _die_before_every_step(go_read)
            real_write(out_dir, model, table, *args, **kwargs)
            os._exit(0)
        os.close(go_read)
        k = 0
        while True:
            _, status = os.wait()
            if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
                break
            if not (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL):
                raise SystemExit(f"fault_harness: a writer ended with status {status}")
            k += 1
            shutil.copytree(folder, results / f"{k:03d}", symlinks=True)
            os.write(go_write, b"x")
        print(f"fault_harness: killed at {k} steps", file=sys.stderr)
        shutil.rmtree(folder)
        shutil.copytree(saved, folder, symlinks=True)
        return real_write(out_dir, model, table, *args, **kwargs)

    return write_with_kills


if __name__ == "__main__":
    split = sys.argv.index("--")
    results, options, fit_args = Path(sys.argv[1]), sys.argv[2:split], sys.argv[split + 1:]
    results.mkdir(parents=True)
    if "--no-exchange" in options:
        pipeline.io.run_folder._exchange = lambda a, b: False
    pipeline.fit.outputs.write_fit_outputs = _series(results, pipeline.fit.outputs.write_fit_outputs)
    sys.exit(main(["fit", *fit_args]))
