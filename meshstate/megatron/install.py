"""Serve meshstate's ``parallel_state``, ``HyperCommGrid`` and ``ProcessGroupCollection``
under megatron-core's names, so legacy code switches without editing an import.

Example::

    import meshstate.megatron
    meshstate.megatron.install()

    from megatron.core import parallel_state          # meshstate's module
    from megatron.core.tensor_parallel import ColumnParallelLinear

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    parallel_state.get_mesh()                         # the ParallelMesh behind every getter

``install()`` works before megatron-core is imported and after. Before, an
import hook answers ``import megatron.core.parallel_state`` with meshstate's
module and replaces the two classes as their modules load, so every module
imported later binds meshstate's objects. After, it also rebinds every
module-level name that already holds one of megatron-core's originals (the
module, a function imported with ``from megatron.core.parallel_state import
...``, a class) in every loaded module but meshstate's own. References kept
elsewhere (an object's attribute, a ``functools.partial``) keep what they hold.
megatron-core need not be installed: the hook waits for the import.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import sys
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType

from meshstate.megatron import parallel_state
from meshstate.megatron.hyper_comm_grid import HyperCommGrid
from meshstate.megatron.process_groups import ProcessGroupCollection

__all__ = ["install", "uninstall"]

PARALLEL_STATE = "megatron.core.parallel_state"

# megatron-core module -> (the class in it that meshstate replaces, meshstate's class)
CLASSES: dict[str, tuple[str, type]] = {
    "megatron.core.hyper_comm_grid": ("HyperCommGrid", HyperCommGrid),
    "megatron.core.process_groups_config": ("ProcessGroupCollection", ProcessGroupCollection),
}


def install() -> None:
    """Make megatron-core's ``parallel_state``, ``HyperCommGrid`` and
    ``ProcessGroupCollection`` meshstate's for every importer; a second call does nothing.

    Example: ``install(); from megatron.core import parallel_state as mpu`` gives
    ``meshstate.megatron.parallel_state``, so ``mpu.get_mesh()`` works.
    """
    if _active_hook() is not None:
        return
    hook = _MegatronHook()
    sys.meta_path.insert(0, hook)
    hook.megatron_parallel_state = sys.modules.get(PARALLEL_STATE)
    if hook.megatron_parallel_state is not None:
        sys.modules[PARALLEL_STATE] = parallel_state
    for module_name, (class_name, _) in CLASSES.items():
        if module_name in sys.modules:
            hook.megatron_classes[module_name] = getattr(sys.modules[module_name], class_name)
    hook.rebound = _rebind(_modules(_is_not_meshstate), _pairs(hook))


def uninstall() -> None:
    """Undo :func:`install`: megatron-core's own objects come back (for tests).

    The hook is removed; every ``megatron.*`` module gets megatron-core's objects
    back (its ``parallel_state`` is loaded now if it never was) and so does every
    other name that ``install()`` rebound. Does nothing when not installed.
    """
    hook = _active_hook()
    if hook is None:
        return
    sys.meta_path.remove(hook)
    if sys.modules.get(PARALLEL_STATE) is parallel_state:
        del sys.modules[PARALLEL_STATE]
    if hook.megatron_parallel_state is not None:
        sys.modules[PARALLEL_STATE] = hook.megatron_parallel_state
    elif "megatron.core" in sys.modules:
        hook.megatron_parallel_state = importlib.import_module(PARALLEL_STATE)
    restorations = [(meshstate_object, megatron_object)
                    for megatron_object, meshstate_object in _pairs(hook)]
    _rebind(_modules(_is_megatron), restorations)
    for module, name, megatron_object, meshstate_object in hook.rebound:
        if getattr(module, name, None) is meshstate_object:
            setattr(module, name, megatron_object)


class _MegatronHook(importlib.abc.MetaPathFinder):
    """The import hook that :func:`install` puts first on ``sys.meta_path``."""

    def __init__(self) -> None:
        # megatron-core's own objects that meshstate's stand in for, where they were loaded.
        self.megatron_parallel_state: ModuleType | None = None
        self.megatron_classes: dict[str, type] = {}  # by module name, as in CLASSES
        # What install() rebound: (module, name, megatron-core's object, meshstate's).
        self.rebound: list[tuple[ModuleType, str, object, object]] = []

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname == PARALLEL_STATE:
            return importlib.util.spec_from_loader(fullname, _ServeModule(parallel_state))
        if fullname not in CLASSES:
            return None
        spec = self._spec_of_megatron_module(fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _SwapClass(spec.loader, self)
        return spec

    def _spec_of_megatron_module(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None
    ) -> importlib.machinery.ModuleSpec | None:
        """The spec the finders after this hook give ``fullname``."""
        for finder in sys.meta_path:
            find_spec = getattr(finder, "find_spec", None)
            if finder is not self and find_spec is not None:
                spec: importlib.machinery.ModuleSpec | None = find_spec(fullname, path, target)
                if spec is not None:
                    return spec
        return None


class _ServeModule(importlib.abc.Loader):
    """Loads an existing module under another name."""

    def __init__(self, module: ModuleType) -> None:
        self.module = module
        self.own_spec = module.__spec__

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return self.module

    def exec_module(self, module: ModuleType) -> None:
        # The import system set __spec__ to the borrowed name's spec; the module keeps its own.
        module.__spec__ = self.own_spec


class _SwapClass(importlib.abc.Loader):
    """Runs megatron-core's module, then puts meshstate's class in place of its own."""

    def __init__(self, loader: importlib.abc.Loader, hook: _MegatronHook) -> None:
        self.loader = loader
        self.hook = hook

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        class_name, meshstate_class = CLASSES[module.__name__]
        self.hook.megatron_classes[module.__name__] = getattr(module, class_name)
        setattr(module, class_name, meshstate_class)


def _active_hook() -> _MegatronHook | None:
    return next((f for f in sys.meta_path if isinstance(f, _MegatronHook)), None)


def _pairs(hook: _MegatronHook) -> list[tuple[object, object]]:
    """(megatron-core's object, meshstate's) for each loaded original: the classes,
    ``parallel_state`` and every function and class that module defines."""
    pairs: list[tuple[object, object]] = [
        (megatron_class, CLASSES[module_name][1])
        for module_name, megatron_class in hook.megatron_classes.items()
    ]
    if hook.megatron_parallel_state is not None:
        pairs.append((hook.megatron_parallel_state, parallel_state))
        pairs.extend(
            (value, getattr(parallel_state, name))
            for name, value in vars(hook.megatron_parallel_state).items()
            if (inspect.isfunction(value) or inspect.isclass(value))
            and value.__module__ == PARALLEL_STATE
            and hasattr(parallel_state, name)
        )
    return pairs


def _rebind(
    modules: Iterator[ModuleType], pairs: list[tuple[object, object]]
) -> list[tuple[ModuleType, str, object, object]]:
    """Point every name in ``modules`` that holds a pair's first object at its second;
    return what was rebound as (module, name, old object, new object)."""
    replacement_by_id = {id(old): (old, new) for old, new in pairs}
    rebound = []
    for module in modules:
        # object.__getattribute__: reading a lazily loaded module's namespace must not load it.
        namespace: dict[str, object] = object.__getattribute__(module, "__dict__")
        for name, value in list(namespace.items()):
            pair = replacement_by_id.get(id(value))
            if pair is not None and pair[0] is value:
                setattr(module, name, pair[1])
                rebound.append((module, name, *pair))
    return rebound


def _modules(wanted: Callable[[str], bool]) -> Iterator[ModuleType]:
    for name, module in list(sys.modules.items()):
        if isinstance(module, ModuleType) and wanted(name):
            yield module


def _is_megatron(name: str) -> bool:
    return name == "megatron" or name.startswith("megatron.")


def _is_not_meshstate(name: str) -> bool:
    return name != "meshstate" and not name.startswith("meshstate.")
