"""Shared test set-up: runs before any test module imports diffusers or transformers.

xfuse's tests are offline by design: tiny models are built from configs or saved to temporary folders, never fetched.
``HF_HUB_OFFLINE=1`` makes a hub id fail at once instead of retrying for ~23 s; spawned ranks and subprocesses
inherit it from this process's environment.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
