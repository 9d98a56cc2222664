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
_CHECK_EXAMPLES = """
import json, resource, sys
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
from schemas.templates import Template, examples_problem
print(json.dumps(examples_problem(Template.model_validate_json(sys.stdin.read(),
                                                               context={"stored": True}))))
"""


def _examples_problem_bounded(template: Template, timeout_s: float) -> str | None:
    from schemas import get_settings

    memory = get_settings().schema_check_memory_mb << 20
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _CHECK_EXAMPLES, str(memory)],
            input=template.model_dump_json(),
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return (
            f"checking the examples against json_schema took over {timeout_s:g}s (a pattern "
            "that backtracks, like ^(a+)+$?); simplify the schema's patterns"
        )
    if proc.returncode != 0:
        if "MemoryError" in proc.stderr:
            return f"checking the examples against json_schema needed more than {memory >> 20} MiB"
        raise RuntimeError(f"the template check failed: {proc.stderr.strip()[-500:]}")
    problem: str | None = json.loads(proc.stdout)
    return problem


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
