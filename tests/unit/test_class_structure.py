"""Issue 19: classes are composed, not glued: no class in shoal/ skips its parent's ``__init__``.

A class that defines ``__init__`` while a base class (other than ``object``, a Protocol, an ABC, an
exception or a torch/stdlib class) defines one too must run it (``super().__init__`` or
``Base.__init__``): a subclass that skips it is a class pretending to be its parent with attributes
set by hand (how ElasticGroup once subclassed Group)."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import textwrap

import shoal


def _shoal_classes() -> list[type]:
    out: list[type] = []
    for info in pkgutil.walk_packages(shoal.__path__, "shoal."):
        if info.name.startswith("shoal.__main__"):
            continue
        mod = importlib.import_module(info.name)
        out += [c for _, c in inspect.getmembers(mod, inspect.isclass) if c.__module__ == info.name]
    return out


def _calls_parent_init(cls: type, fn: object, seen: set[str] | None = None) -> bool:
    """Whether ``fn`` runs a parent's ``__init__``, itself or through a helper method it calls on self."""
    seen = set() if seen is None else seen
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))   # type: ignore[arg-type]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "__init__":
            return True
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "self" \
                and node.func.attr not in seen:
            seen.add(node.func.attr)
            helper = getattr(cls, node.func.attr, None)
            if inspect.isfunction(helper) and _calls_parent_init(cls, helper, seen):
                return True
    return False


def _skips(cls: type) -> str | None:
    if "__init__" not in cls.__dict__:
        return None
    parents = [b for b in cls.__mro__[1:] if b.__module__.startswith("shoal") and "__init__" in b.__dict__]
    if not parents or _calls_parent_init(cls, cls.__dict__["__init__"]):
        return None
    return f"{cls.__module__}.{cls.__qualname__} skips {parents[0].__qualname__}.__init__"


def test_the_check_finds_a_skipped_init() -> None:
    class Base:
        def __init__(self) -> None:
            self.x = 1

    class Skips(Base):
        def __init__(self) -> None:      # sets its own attributes, never Base's
            self.y = 2

    class Runs(Base):
        def __init__(self) -> None:
            super().__init__()

    Base.__module__ = Skips.__module__ = Runs.__module__ = "shoal.fake"
    assert _skips(Skips) is not None and _skips(Runs) is None


def test_no_shoal_class_skips_its_parents_init() -> None:
    bad = [why for cls in _shoal_classes() if (why := _skips(cls))]
    assert not bad, bad


def test_a_round_group_holds_an_elastic_group_and_elastic_groups_are_groups() -> None:
    from shoal.collaborative.rounds import RoundGroup
    from shoal.comm.group import Group
    from shoal.membership.elastic import ElasticGroup
    from shoal.membership.views import ElasticSubgroup

    assert not issubclass(RoundGroup, ElasticGroup)
    assert not any(Group in c.__mro__ for c in (ElasticGroup, ElasticSubgroup))   # composed, not inherited
    assert issubclass(ElasticGroup, Group) and issubclass(ElasticSubgroup, Group)  # registered: isinstance works
