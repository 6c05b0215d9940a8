"""gputrace's arming hook, found through PYTHONPATH by ``gputrace capture -- CMD`` or ``gputrace env``.

Without GPUTRACE_AGENT_SOCK or GPUTRACE_AGENT in the environment this does nothing but hand over to the
next ``sitecustomize`` on sys.path, so the target's own keeps working. It never raises and never prints:
the traced program must behave exactly as it would untraced.
"""

import os
import sys


def _chain() -> None:
    """Run the sitecustomize this one shadows (the next one on sys.path), under the same name."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    later = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", later)
    if spec is None or spec.loader is None or spec.origin == os.path.abspath(__file__):
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


def _arm() -> None:
    try:
        from gputrace.agent import arming
    except ModuleNotFoundError as e:
        if e.name != "gputrace" or not _load_from_home():
            return
        from gputrace.agent import arming
    arming.arm()


def _load_from_home() -> bool:
    """Load only the gputrace package from GPUTRACE_HOME, not its siblings in that directory."""
    import importlib.util

    init = os.path.join(os.environ.get("GPUTRACE_HOME", ""), "gputrace", "__init__.py")
    if not os.path.isfile(init):
        return False
    spec = importlib.util.spec_from_file_location("gputrace", init, submodule_search_locations=[os.path.dirname(init)])
    if spec is None or spec.loader is None:
        return False
    module = importlib.util.module_from_spec(spec)
    sys.modules["gputrace"] = module
    spec.loader.exec_module(module)
    return True


if os.environ.get("GPUTRACE_AGENT_SOCK") or os.environ.get("GPUTRACE_AGENT", "0") not in ("", "0"):
    try:  # noqa: SIM105
        _arm()
    except Exception:  # noqa: BLE001, SIM105 - the target must start regardless; contextlib is not loaded yet
        pass
try:
    _chain()
except Exception as err:  # noqa: BLE001
    # The shadowed sitecustomize failed: report it exactly as site.py would have without us.
    sys.stderr.write(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{type(err).__name__}: {err}\n")
