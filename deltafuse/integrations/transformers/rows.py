"""The data a family map is made of: ``Route`` rows and the ``FamilyMap`` that holds them.

A family map (``qwen3_5.py`` ...) is data: the modeling module it patches and a tuple of ``Route`` rows.
A row names a target and what to put there:

* ``global``   - a module global (``owner`` empty), looked up by name by transformers at call or init time;
* ``class``    - a class attribute of class ``owner`` (a method: ``wrap=True`` builds the new method from the
  original one);
* ``instance`` - an attribute every instance of ``owner`` cached in its ``__init__`` (old design); applied to
  the instances of a model passed to ``apply``.
* ``mapping``  - key ``attr`` of the dict at the dotted import path ``mapping`` (a registry of named
  implementations that ``owner``, a class of the family module, looks names up in); the key is added or its
  value replaced, and removed or restored on revert.

``design`` restricts a row to the old ("old": the module defines ``design_marker``) or new ("new") design
of transformers' GDN integration. ``layer`` 1 marks a row over what a layer-0 row put at the same target (the
``context_parallel`` rows over the ``gdn`` and ``fused_ops`` ones): it keeps its own record, so that reverting
puts back each layer in turn and re-applying either layer is recognised.
``deltafuse.integrations.transformers.patcher`` applies the rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MISSING = object()  # what a record or report holds for an attribute or key that did not exist
KINDS = ("global", "class", "instance", "mapping")
DESIGNS = ("any", "old", "new")
SWITCHES = ("gdn", "fused_ops", "moe", "context_parallel")
LAYERS = (0, 1)


@dataclass(frozen=True)
class Route:
    switch: str
    kind: str
    owner: str
    attr: str
    replacement: Any
    design: str = "any"
    wrap: bool = False
    init_from: tuple[str, ...] = ()
    note: str = ""
    mapping: str = ""
    # the note holds only where the family module's global of this name is, as transformers set it, not None
    # (e.g. "FusedRMSNormGated": FLA's norm, old design with FLA importable); "" = always
    note_if: str = ""
    # 0: over what transformers put at the target; 1: over what a layer-0 row of the same target put there
    layer: int = 0

    def __post_init__(self):
        if self.switch not in SWITCHES:
            raise ValueError(f"Route.switch={self.switch!r}; allowed: {', '.join(SWITCHES)}")
        if self.kind not in KINDS:
            raise ValueError(f"Route.kind={self.kind!r}; allowed: {', '.join(KINDS)}")
        if self.design not in DESIGNS:
            raise ValueError(f"Route.design={self.design!r}; allowed: {', '.join(DESIGNS)}")
        if self.layer not in LAYERS:
            raise ValueError(f"Route.layer={self.layer!r}; allowed: {', '.join(map(str, LAYERS))}")
        if self.kind != "global" and not self.owner:
            raise ValueError(f"Route {self.attr!r}: kind={self.kind!r} needs the owning class name")
        if (self.kind == "mapping") != bool(self.mapping):
            raise ValueError(f"Route {self.attr!r}: mapping={self.mapping!r} with kind={self.kind!r}; a dotted import "
                             "path of a dict is required for kind 'mapping' and allowed for no other kind")

    def target_name(self, module: str) -> str:
        if self.kind == "global":
            return f"{module}.{self.attr}"
        if self.kind == "class":
            return f"{module}.{self.owner}.{self.attr}"
        if self.kind == "mapping":
            return f"{self.mapping}[{self.attr!r}]"
        return f"{module}.{self.owner}(instance).{self.attr}"


@dataclass(frozen=True)
class FamilyMap:
    """Everything deltafuse knows about one model family (or, with ``models=False``, one library).

    family: the family's name (``config_family`` / ``model_family`` return it); module: the modeling module
    the rows patch; routes: the rows. title: how messages name the family. config_classes: the config classes
    of its models (the first is the one named models are built from); model_classes: the model classes
    deltafuse supports (the first is the causal LM named models build); both are looked up in the package
    of ``module``. tiny_name / tiny_config: the CPU-sized test model of the family (keyword arguments of the
    first config class).
    """

    family: str
    module: str
    routes: tuple[Route, ...]
    design_marker: str = "is_fast_path_available"
    doc: str = ""
    # False for a library's map (TRL): it defines no model classes, so ``owns`` and model search ignore it
    models: bool = True
    # a top-level package that must already be imported for the map to apply (``apply`` does not import it)
    when_imported: str = ""
    title: str = ""
    config_classes: tuple[str, ...] = ()
    model_classes: tuple[str, ...] = ()
    tiny_name: str = ""
    tiny_config: dict = field(default_factory=dict, hash=False)

    @property
    def package(self) -> str:
        """The transformers package of the family (``transformers.models.qwen3_5``)."""
        return self.module.rsplit(".", 1)[0]

