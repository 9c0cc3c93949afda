"""``import deltafuse.auto`` applies deltafuse according to the environment (DELTAFUSE_* switches).

For launchers that cannot edit the training script: e.g. ``python -c "import deltafuse.auto; ..."`` or a
``sitecustomize``. Models built after this import use the patched modeling modules.
"""

from deltafuse.patching import apply

REPORT = apply()
