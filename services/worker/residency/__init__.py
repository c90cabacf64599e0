"""Load-adaptive residency (DESIGN §4), mode ``adaptive``:

- ``optional_history``: pages of imported history kept on the device while memory is spare;
- ``reclaim``: whole requests' optional pages taken back for an admission (eq. 4);
- ``repopulation``: bounded round-robin refill when memory frees;
- ``policy``: whom to reclaim and whom to refill (pure, no tensors);
- ``residency``: admission, the accounts of eq. 3 and the copies between steps;
- ``completions`` / ``check``: when copies are done, the invariant (settings:
  ``kv.config.ResidencyConfig``)."""
