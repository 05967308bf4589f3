"""The server's own helper module, imported as `sibling` (NeMo Gym's `calendar` imports its `utils` so)."""

TERMINAL = "Search finished. Write your answer now."
