"""Test-only fault injection (tests/integration/test_refit_verification.py): a lost weight sync.

On PYTHONPATH, Python imports this module at the start of every process, vLLM's engine core included. With
NRC_TEST_LOSE_SYNCS_AFTER=k set, the worker extension's shared-buffer load does nothing after its first k calls:
the engine keeps its weights while the trainer's change, as a refit that silently failed would leave it.
"""

import os

_AFTER = os.environ.get("NRC_TEST_LOSE_SYNCS_AFTER")
if _AFTER is not None:
    from nemo_rollout_correction.rollout.worker_extension import RefitExtension

    _load = RefitExtension.nrc_reload_from_shared
    _calls = [0]

    def _lossy(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        _calls[0] += 1
        if _calls[0] > int(_AFTER):
            return {"num_tensors": 0, "seconds": 0.0, "repacked": 0, "path": "lost", "why_not_direct": ""}
        return _load(self, *args, **kwargs)

    RefitExtension.nrc_reload_from_shared = _lossy  # type: ignore[method-assign]
