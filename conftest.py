"""Shared pytest hooks for the unit tests and the notebook (nbval) runs."""


def pytest_sessionfinish(session, exitstatus):
    # Multi-rank runs started outside dslab.launch (torchrun, per-node launches) leave DeepSpeed's
    # shared-memory all-reduce buffers behind; free that RAM once the session is over.
    from dslab.launch import remove_stale_shm_buffers

    remove_stale_shm_buffers()
