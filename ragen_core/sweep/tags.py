"""The MLflow tags of a sweep's runs: the sweep flow writes them, the report reads them back.

One place for the names, so that the writer and the reader cannot drift apart.
"""

from __future__ import annotations

# Parent and children.
SWEEP_TAG = "ragen.sweep"  # the sweep's name
SWEEP_HASH_TAG = "ragen.sweep_hash"  # the definition's digest
ROLE_TAG = "ragen.sweep_role"  # "parent" or "member"

# Children (one per member).
MEMBER_TAG = "ragen.sweep_member"  # the member key
GROUP_TAG = "ragen.sweep_group"  # the member's group (name without the seed)
SEED_TAG = "ragen.seed"  # the seed
INDEX_TAG = "ragen.sweep_index"  # position in the expansion (report order)
OVERRIDES_TAG = "ragen.sweep_overrides"  # the member's overrides (JSON list)
ERROR_TAG = "ragen.sweep_error"  # why the member failed

# Parent only: what the report needs besides the children.
COMPARE_TAG = "ragen.sweep.compare"  # the sweep file's ``compare`` (JSON list)
DESCRIPTION_TAG = "ragen.sweep.description"  # the sweep file's ``description``
