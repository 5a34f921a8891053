"""Run a function on a module right after it is imported: sorl_verl's one after-import hook.

Several verl registries live in modules that cost seconds to import (the v1 trainers, the agent
loop, the checkpoint engines), and most verl processes never import them. The plugin writes into
them only when the process imports them itself: :func:`after_import` calls ``install(module)`` at
once when the module is loaded, else right after the module's code has run.

The deferred path is one ``sys.meta_path`` finder per process. For a module with hooks pending it
asks the other finders for the module's spec and wraps the loader; after the module has executed,
the real loader is put back, the module's hooks are dropped (each runs once) and then called.
The finder removes itself when no hook is pending. A deferred ``install`` that raises must not
break verl's own import: the traceback is logged at WARNING and handed to ``on_error``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
import threading
import traceback
from collections.abc import Callable
from types import ModuleType
from typing import Any

logger = logging.getLogger("sorl_verl.after_import")

Install = Callable[[ModuleType], None]
OnError = Callable[[str], None]

_lock = threading.Lock()
#: module name -> hook name -> (install, on_error): what runs once that module has been imported
_PENDING: dict[str, dict[str, tuple[Install, OnError | None]]] = {}


def after_import(
    module_name: str, ready_attr: str, install: Install, hook: str, on_error: OnError | None = None
) -> bool:
    """Call ``install(module)`` now if ``module_name`` is loaded (has ``ready_attr``), else right after it loads.

    ``hook`` names the hook: registering one that is already pending changes nothing (a plugin
    imported twice installs it once). Returns True when ``install`` ran now; an immediate
    ``install`` that raises raises here, a deferred one goes to ``on_error``.
    """
    module = sys.modules.get(module_name)
    if module is not None and hasattr(module, ready_attr):
        install(module)
        return True
    with _lock:
        _PENDING.setdefault(module_name, {}).setdefault(hook, (install, on_error))
        if _FINDER not in sys.meta_path:
            sys.meta_path.insert(0, _FINDER)
    return False


def pending(module_name: str) -> list[str]:
    """Names of the hooks waiting for ``module_name`` to be imported in this process."""
    return list(_PENDING.get(module_name, {}))


def _run_hooks(module: ModuleType, name: str) -> None:
    with _lock:
        hooks = _PENDING.pop(name, {})
        if not _PENDING and _FINDER in sys.meta_path:
            sys.meta_path.remove(_FINDER)
    for hook, (install, on_error) in hooks.items():
        try:
            install(module)
        except Exception:  # noqa: BLE001 - must not break verl's own import; made visible instead
            tb = traceback.format_exc()
            logger.warning("sorl_verl: the after-import hook %r on %s failed:\n%s", hook, name, tb)
            if on_error is not None:
                on_error(tb)


class _AfterImportFinder(importlib.abc.MetaPathFinder):
    """Finds a module with pending hooks through the other finders and wraps its loader."""

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None) -> Any:
        if fullname not in _PENDING:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _AfterExecLoader(spec.loader)
        return spec


class _AfterExecLoader(importlib.abc.Loader):
    """Delegates to the real loader; after ``exec_module`` puts it back and runs the module's hooks."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        _run_hooks(module, module.__name__)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


_FINDER = _AfterImportFinder()
