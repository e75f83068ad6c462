"""A process on a shared directory tier that stops where a fault test wants it (see test_faults.py).

``python fault_child.py ROOT MODE`` encodes prompt 0 of test_tiers on ROOT with the directory tier
and prints ``there`` when it reaches the point MODE names, then:

* ``kill-before-rename``: has written its temporary file and waits before renaming it (the test
  kills it there with SIGKILL);
* ``stop-while-encoding``: holds the entry's claim and waits inside its encode for a line on its
  standard input (the test stops it with SIGSTOP, resumes it with SIGCONT, then sends the line); it
  then finishes, and prints ``served the same`` when its output equals an uncached encode.
"""

from __future__ import annotations

import os
import sys
import time

from test_tiers import encode, process, reference, same


def stall_in_forward(module, args) -> None:
    """A forward pre-hook: the encoder is about to run, so this process holds the entry's claim."""
    print("there", flush=True)
    sys.stdin.readline()  # the test stops this process here, resumes it, then lets it go on


def main(root: str, mode: str) -> None:
    if mode == "kill-before-rename":
        pipeline, _ = process(root)
        rename = os.replace

        def stall_before_rename(source, target):
            if str(target).endswith(".safetensors"):
                print("there", flush=True)
                time.sleep(600)  # the test kills this process here
            return rename(source, target)

        os.replace = stall_before_rename
    elif mode == "stop-while-encoding":
        pipeline, _ = process(root)  # the test's pipeline class and code: the same namespace
        pipeline.text_encoder.register_forward_pre_hook(stall_in_forward)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    served = encode(pipeline, 0)
    print("served the same" if same(served, reference(0)) else "served another", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
