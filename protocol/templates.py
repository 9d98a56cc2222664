"""Extraction templates users register, kept in Redis (``schemas/templates.py`` has the built-in
ones). A template belongs to one tenant (its examples may be that tenant's data), or, registered
as shared (``tenant=None``), to every tenant; a tenant's own name hides a shared one.

- ``{p}:templates``               hash: name -> template JSON, shared by every tenant
- ``{p}:tenant:{t}:templates``    hash: name -> template JSON, tenant ``t``'s own
"""

from __future__ import annotations

import json
import subprocess
import sys

from schemas.templates import Template

from .scripts import StoreBase

TEMPLATE_CHECK_S = 5.0  # for a template's examples against its schema, at registration
_STORED = {"stored": True}  # validation context: checked when it was added
# a child's start (an interpreter, pydantic, jsonschema) is not the check: the time bound runs
# from its "ready", which a loaded host may take many seconds to reach
START_S = 120.0
_CHECK_EXAMPLES = """
import json, resource, sys
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
from schemas.templates import Template, examples_problem
print("ready", flush=True)
print(json.dumps(examples_problem(Template.model_validate_json(sys.stdin.readline(),
                                                               context={"stored": True}))))
"""


def _examples_problem_bounded(template: Template, timeout_s: float) -> str | None:
    """What is wrong with the template's examples, checked in a child bounded in memory and
    given ``timeout_s`` once it is ready to check."""
    from schemas import get_settings

    memory = get_settings().schema_check_memory_mb << 20
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHECK_EXAMPLES, str(memory)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdin is not None and proc.stdout is not None
        ready = _line_within(proc, START_S)
        if ready != "ready":
            _, err = proc.communicate(timeout=START_S)
            raise RuntimeError(f"the template check failed: {err.strip()[-500:]}")
        proc.stdin.write(template.model_dump_json() + "\n")
        proc.stdin.flush()
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return (
                f"checking the examples against json_schema took over {timeout_s:g}s (a "
                "pattern that backtracks, like ^(a+)+$?); simplify the schema's patterns"
            )
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0:
        if "MemoryError" in err:
            return f"checking the examples against json_schema needed more than {memory >> 20} MiB"
        raise RuntimeError(f"the template check failed: {err.strip()[-500:]}")
    problem: str | None = json.loads(out)
    return problem


def _line_within(proc: subprocess.Popen[str], timeout_s: float) -> str | None:
    """The child's first line of output, or None if it gives none within ``timeout_s``."""
    import selectors

    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout_s):
            return None
    return proc.stdout.readline().strip()


class Templates(StoreBase):
    def templates_key(self, tenant: str | None) -> str:
        return f"{self.prefix}:" + (f"tenant:{tenant}:templates" if tenant else "templates")

    def add_template(
        self, template: Template, tenant: str | None, check_s: float = TEMPLATE_CHECK_S
    ) -> None:
        """Register ``template`` for ``tenant``'s jobs (every tenant's: None). Its worked
        examples are checked against its schema here, once, in a child process given
        ``check_s`` seconds (a ``pattern`` can keep Python's regex engine busy for minutes);
        workers read it back without checking again. Raises ``ValueError`` when the examples do
        not fit, or the check runs out of time."""
        problem = _examples_problem_bounded(template, check_s)
        if problem:
            raise ValueError(problem)
        self.r.hset(self.templates_key(tenant), template.name, template.model_dump_json())

    def template(self, name: str, tenant: str | None) -> Template | None:
        """The template ``tenant``'s jobs get by ``name``: its own, else a shared one; as it
        was checked when added (``pydantic.ValidationError`` if it no longer reads as one)."""
        for key in dict.fromkeys([self.templates_key(tenant), self.templates_key(None)]):
            raw = self.r.hget(key, name)
            if raw:
                return Template.model_validate_json(raw, context=_STORED)
        return None

    def templates(self, tenant: str | None) -> list[tuple[Template, str]]:
        """The templates ``tenant`` can name, with where each is from (``shared`` or
        ``tenant``), every one that still reads as one."""
        found: dict[str, tuple[str, str]] = {}
        for key, origin in (
            (self.templates_key(None), "shared"),
            (self.templates_key(tenant), "tenant"),
        ):
            if origin == "tenant" and not tenant:
                continue
            for name, raw in self.r.hgetall(key).items():
                found[name] = (raw, origin)
        out = []
        for _, (raw, origin) in sorted(found.items()):
            try:
                out.append((Template.model_validate_json(raw, context=_STORED), origin))
            except ValueError:  # pydantic's ValidationError: `vqueue templates add` replaces it
                continue
        return out

    def remove_template(self, name: str, tenant: str | None) -> bool:
        return bool(self.r.hdel(self.templates_key(tenant), name))
