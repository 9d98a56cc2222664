"""Result quality through the full queue, on a labelled set, with whatever model is configured.

    .venv/bin/python -m benchmarks.quality [--model smollm2-135m-instruct] [--redis URL]

Real workers (``vqueue worker``), real Redis, the producer's ``Client``; English and Chinese cases:

- extraction with expected values: schema-valid rate and value accuracy (each expected field
  compared after trimming and case-folding; arrays as sets), with the built-in templates and
  again with the same schemas given bare (no template's instruction or worked examples);
- code tasks with tests: the extracted code and the tests run in a fresh Python, 10 s each;
- summaries: language match (Chinese: more than half the letters Han; English: no Han), length
  budget (words, or Han characters / 2, at most 1.5 x ``max_words``), finish reasons;
- loops: extraction jobs whose arrays have no ``maxItems``, on a worker with loop detection and
  on one without (``VQUEUE_LOOP_DETECTION=off``): valid results, and tokens generated;
- early stop: false alarms on the greedy cases (attempts the monitor aborted), then summaries
  and code at temperature 1.8 with early stop off and on: aborts, tokens, seconds.

``--only codegen`` runs the codegen-with-tests set alone (``benchmarks/codegen_set.py``: 30
tasks, English and Chinese instructions) through the worker's sandbox: pass@1 and pass@k
(``--attempts``), and writes benchmarks/results/quality-codegen-<model>-<date>.json.

Prints a table and writes benchmarks/results/quality-<model>-<date>.json. docs/quality.md
records the numbers for the embedded model.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks import plugin_env
from schemas import Settings

from .gpu_suite import launch_worker, stop

ROOT = Path(__file__).resolve().parent.parent

# -- extraction: (id, language, text, template or schema, expected values)
STR = {"type": "string"}
NSTR = {"type": ["string", "null"]}


def _obj(**props: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": props,
        "required": list(props),
        "additionalProperties": False,
    }


EXTRACT: list[dict[str, Any]] = [
    {
        "id": "contact-en",
        "lang": "en",
        "template": "contact",
        "text": "For questions about the audit, write to Priya Raman, finance director at "
        "Northwind Traders, at priya.raman@northwind.example, or call +1 415 555 0142.",
        "expected": {
            "name": "Priya Raman",
            "organization": "Northwind Traders",
            "email": "priya.raman@northwind.example",
            "phone": "+1 415 555 0142",
        },
    },
    {
        "id": "contact-zh",
        "lang": "zh",
        "template": "contact",
        "text": "如需合作，请联系上海明达科技有限公司市场部经理王丽，电话 021-6543 2100，"
        "邮箱 wangli@mingda.example。",
        "expected": {"name": "王丽", "email": "wangli@mingda.example", "phone": "021-6543 2100"},
    },
    {
        "id": "invoice-en",
        "lang": "en",
        "template": "invoice",
        "text": "INVOICE INV-2291 from Acme Paper Co., dated 2026-03-14. 200 reams of A4 paper "
        "at 4.50 each. Total due: 900.00 USD by 2026-04-13.",
        "expected": {"invoice_number": "INV-2291", "seller": "Acme Paper Co.", "total": 900.0},
    },
    {
        "id": "event-en",
        "lang": "en",
        "template": "event",
        "text": "The annual volunteer picnic takes place on 2026-06-20 at Riverside Park, "
        "starting at 12:00. Families are welcome.",
        "expected": {"location": "Riverside Park", "date": "2026-06-20"},
    },
    {
        "id": "order-en",
        "lang": "en",
        "schema": _obj(customer=STR, product=STR, quantity={"type": "integer"}),
        "text": "Order confirmation: Daniel Kim ordered 3 units of the Trailblazer backpack.",
        "expected": {"customer": "Daniel Kim", "product": "Trailblazer backpack", "quantity": 3},
    },
    {
        "id": "order-zh",
        "lang": "zh",
        "schema": _obj(customer=STR, product=STR, quantity={"type": "integer"}),
        "text": "订单确认：李明购买了5台星光牌台灯。",
        "expected": {"customer": "李明", "quantity": 5},
    },
]

# arrays without maxItems: where a small model repeats one item until max_tokens (issue 23)
LOOPS: list[dict[str, Any]] = [
    {
        "id": "skills-en",
        "lang": "en",
        "schema": _obj(title=STR, skills={"type": "array", "items": STR}),
        "text": "We are hiring a data engineer. You know Python, SQL and Airflow, and have "
        "worked with Spark. Experience with Kafka is a plus.",
        "expected": {"title": "data engineer", "skills": ["Python", "SQL", "Airflow", "Spark"]},
    },
    {
        "id": "attendees-en",
        "lang": "en",
        "schema": _obj(topic=STR, attendees={"type": "array", "items": STR}),
        "text": "Minutes of the budget review. Present: Sara Wei, Tom Okafor, Lena Fischer. "
        "Sara Wei presented the forecast; Tom Okafor asked about travel costs.",
        "expected": {"attendees": ["Sara Wei", "Tom Okafor", "Lena Fischer"]},
    },
    {
        "id": "ingredients-en",
        "lang": "en",
        "schema": _obj(dish=STR, ingredients={"type": "array", "items": STR}),
        "text": "Tomato soup: soften an onion in butter, add two cans of tomatoes and a litre "
        "of stock, simmer, then blend with a little cream and salt.",
        "expected": {"ingredients": ["onion", "butter", "tomatoes", "stock", "cream", "salt"]},
    },
    {
        "id": "medications-en",
        "lang": "en",
        "schema": _obj(
            patient=STR,
            medications={"type": "array", "items": _obj(name=STR, dose=STR)},
        ),
        "text": "Discharge note for Mr. Alan Reyes: continue metformin 500 mg twice daily and "
        "lisinopril 10 mg once daily; start atorvastatin 20 mg at night.",
        "expected": {"patient": "Alan Reyes"},
    },
    {
        "id": "attendees-zh",
        "lang": "zh",
        "schema": _obj(topic=STR, attendees={"type": "array", "items": STR}),
        "text": "项目周会纪要。出席：张伟、刘洋、陈静。张伟汇报了进度，刘洋提出了测试计划。",
        "expected": {"attendees": ["张伟", "刘洋", "陈静"]},
    },
    {
        "id": "tags-en",
        "lang": "en",
        "schema": _obj(headline=STR, tags={"type": "array", "items": STR}),
        "text": "City council approves new bike lanes on Main Street after a year of debate; "
        "construction starts in spring and local shops worry about parking.",
        "expected": {},
    },
    # arrays of objects, whose cycles are one item or several (about 18 to 60 tokens here)
    {
        "id": "order-items-en",
        "lang": "en",
        "schema": _obj(
            customer=STR,
            items={"type": "array", "items": _obj(product=STR, quantity=STR, price=STR)},
        ),
        "text": "Order 4471 from Dana Brooks: two boxes of blue ballpoint pens at 4.50 each, one "
        "ream of A4 paper at 6.20, three yellow highlighters at 1.10 each, and a stapler at 8.75.",
        "expected": {"customer": "Dana Brooks"},
    },  # fmt: skip
    {
        "id": "pancakes-en",
        "lang": "en",
        "schema": _obj(
            dish=STR, ingredients={"type": "array", "items": _obj(item=STR, quantity=STR)}
        ),
        "text": "Pancakes for four: whisk 2 cups of flour with 2 cups of milk, 2 eggs and a pinch "
        "of salt; rest the batter, then fry in a little butter.",
        "expected": {},
    },
    {
        "id": "sessions-en",
        "lang": "en",
        "schema": _obj(
            event=STR,
            sessions={
                "type": "array",
                "items": _obj(day=STR, time=STR, room=STR, speaker=STR, title=STR),
            },
        ),
        "text": "Data Summit programme. Monday 9:00, Hall A: Priya Nair on streaming joins. "
        "Monday 14:00, Room 3: Marco Rossi on lakehouse costs. Tuesday 10:30, Hall B: Aiko "
        "Tanaka on vector search in production.",
        "expected": {},
    },  # fmt: skip
    {
        "id": "contacts-en",
        "lang": "en",
        "schema": _obj(
            company=STR,
            contacts={"type": "array", "items": _obj(name=STR, role=STR, email=STR, phone=STR)},
        ),
        "text": "Northwind Logistics, key contacts: Helen Park, head of procurement, "
        "helen.park@northwind.example, +1 555 0134; Omar Haddad, finance controller, "
        "omar.haddad@northwind.example, +1 555 0178; Grace Liu, warehouse manager, "
        "grace.liu@northwind.example, +1 555 0192; Ben Adler, IT lead, "
        "ben.adler@northwind.example, +1 555 0110.",
        "expected": {"company": "Northwind Logistics"},
    },  # fmt: skip
    {
        "id": "itinerary-zh",
        "lang": "zh",
        "schema": _obj(
            traveller=STR, stops={"type": "array", "items": _obj(date=STR, city=STR, hotel=STR)}
        ),
        "text": "王芳的出差行程：3月2日到上海，住和平饭店；3月4日到杭州，住西湖国宾馆；"
        "3月6日到南京，住金陵饭店；3月8日返回北京。",
        "expected": {},
    },  # fmt: skip
    {
        "id": "grades-en",
        "lang": "en",
        "schema": _obj(
            course=STR, students={"type": "array", "items": _obj(name=STR, grade=STR, comment=STR)}
        ),
        "text": "Chemistry 101 final grades: Ava Johnson, A, excellent lab reports; Liam Chen, "
        "B+, strong exam but late homework; Noah Garcia, B, steady improvement; Mia Patel, A-, "
        "great participation; Ethan Kim, C+, needs to attend office hours.",
        "expected": {"course": "Chemistry 101"},
    },  # fmt: skip
    # longer items: without a loop check the embedded model cycles through one to three of them,
    # about 30 (reviews), 55 (tickets) and 165 (papers) tokens a cycle
    {
        "id": "reviews-en",
        "lang": "en",
        "schema": _obj(
            product=STR,
            reviews={
                "type": "array",
                "items": _obj(author=STR, date=STR, rating=STR, title=STR, body=STR),
            },
        ),
        "text": "Reviews of the Aria kettle. Jan Novak, 3 May: five stars, 'Fast and quiet' - "
        "boils a litre in two minutes and the lid never sticks. Priya Shah, 9 May: three stars, "
        "'Pretty but small' - looks lovely on the counter, though it holds barely enough for four "
        "cups. Tom Berg, 12 May: one star, 'Leaks' - water pooled under the base after a week.",
        "expected": {},
    },  # fmt: skip
    {
        "id": "flights-en",
        "lang": "en",
        "schema": _obj(
            passenger=STR,
            flights={
                "type": "array",
                "items": _obj(
                    flight=STR, origin=STR, destination=STR, departure=STR, arrival=STR, seat=STR
                ),
            },
        ),
        "text": "Itinerary for Maria Lopez: flight IB3166 from Madrid to Paris, departs 07:10, "
        "arrives 09:15, seat 14C; flight AF1480 from Paris to Oslo, departs 11:40, arrives 14:20, "
        "seat 22A; flight SK4035 from Oslo to Tromso, departs 16:05, arrives 17:55, seat 3F.",
        "expected": {"passenger": "Maria Lopez"},
    },  # fmt: skip
    {
        "id": "tickets-en",
        "lang": "en",
        "schema": _obj(
            team=STR,
            tickets={
                "type": "array",
                "items": _obj(
                    id=STR, title=STR, reporter=STR, priority=STR, status=STR, summary=STR
                ),
            },
        ),
        "text": "Support queue for the billing team. BILL-101 'Invoice total wrong' reported by "
        "Ana Silva, high priority, open: the total omits the shipping line. BILL-102 'Duplicate "
        "charge' reported by Ken Ito, urgent, in progress: the card was charged twice for one "
        "order. BILL-103 'Refund missing' reported by Lea Roy, medium, waiting: a refund approved "
        "last week has not arrived.",
        "expected": {},
    },  # fmt: skip
    {
        "id": "papers-en",
        "lang": "en",
        "schema": _obj(
            venue=STR,
            papers={"type": "array", "items": _obj(title=STR, authors=STR, year=STR, abstract=STR)},
        ),
        "text": "Accepted at the Data Systems Workshop: 'Streaming Joins at Scale' by P. Nair and "
        "L. Chen (2024), which shows a join that spills to disk only for skewed keys; 'Cheap "
        "Lakehouse Compaction' by M. Rossi (2023), which halves compaction cost with size-tiered "
        "merges; 'Vector Search in Production' by A. Tanaka and J. Okoro (2024), which reports "
        "recall and latency on ten billion vectors.",
        "expected": {},
    },  # fmt: skip
]

CODE: list[dict[str, Any]] = [
    {
        "id": "add",
        "instruction": "Write a Python function add(a, b) that returns the sum of a and b.",
        "tests": "assert add(2, 3) == 5\nassert add(-1, 1) == 0",
    },
    {
        "id": "is_even",
        "instruction": "Write a Python function is_even(n) that returns True when the integer n "
        "is even and False otherwise.",
        "tests": "assert is_even(4) is True\nassert is_even(7) is False",
    },
    {
        "id": "reverse",
        "instruction": "Write a Python function reverse_string(s) that returns the string s "
        "reversed.",
        "tests": "assert reverse_string('abc') == 'cba'\nassert reverse_string('') == ''",
    },
    {
        "id": "maximum",
        "instruction": "Write a Python function largest(xs) that returns the largest number in "
        "the non-empty list xs.",
        "tests": "assert largest([3, 9, 2]) == 9\nassert largest([-5]) == -5",
    },
    {
        "id": "factorial",
        "instruction": "Write a Python function factorial(n) that returns n! for n >= 0.",
        "tests": "assert factorial(0) == 1\nassert factorial(5) == 120",
    },
    {
        "id": "count_vowels",
        "instruction": "Write a Python function count_vowels(s) that returns how many of the "
        "letters a, e, i, o, u (either case) the string s contains.",
        "tests": "assert count_vowels('Hello') == 2\nassert count_vowels('xyz') == 0",
    },
]

SUMMARIES: list[dict[str, Any]] = [
    {
        "id": "flood-en",
        "lang": "en",
        "text": "Heavy rain has raised river levels across the city, and the flood agency has "
        "started a level-three emergency response. Forecasters expect more storms over the "
        "next three days; residents are asked to stay indoors. About 1,200 people have been "
        "moved and no casualties are reported.",
    },
    {
        "id": "earnings-en",
        "lang": "en",
        "text": "The company's third-quarter revenue rose 12% from a year earlier to 4.5 "
        "billion, driven by fast growth abroad. Management said it would keep raising research "
        "spending and plans to launch two new products next year. Its shares rose 3% after the "
        "announcement.",
    },
    {
        "id": "library-en",
        "lang": "en",
        "text": "The public library will extend its opening hours from next month. Branches "
        "will open at 8 a.m. on weekdays and stay open until 9 p.m. on Thursdays. The change "
        "follows a survey in which most users asked for earlier mornings.",
    },
    {
        "id": "flood-zh",
        "lang": "zh",
        "text": "受持续强降雨影响，本市多条河流水位上涨，防汛部门已启动三级应急响应。"
        "市气象台预计未来三天仍有大到暴雨，请市民减少外出，注意防范山洪和城市内涝。"
        "目前已转移群众一千二百余人，暂无人员伤亡报告。",
    },
    {
        "id": "earnings-zh",
        "lang": "zh",
        "text": "公司第三季度营收同比增长百分之十二，达到四十五亿元，主要得益于海外市场的快速"
        "扩张。管理层表示，将继续加大研发投入，并计划在明年推出两款新产品。",
    },
    {
        "id": "library-zh",
        "lang": "zh",
        "text": "市图书馆将从下月起延长开放时间。各分馆工作日早上八点开门，每周四开放至晚上九点。"
        "此次调整源于一项读者调查，多数读者希望早上提前开馆。",
    },
]
MAX_WORDS = 40
RAMBLE_TEMPERATURE = 1.8


# -- building jobs


def extract_job(case: dict[str, Any], bare: bool = False, suffix: str = "") -> dict[str, Any]:
    from schemas.templates import BUILTIN

    job: dict[str, Any] = {"id": case["id"] + suffix, "type": "extract", "text": case["text"]}
    if "template" in case and not bare:
        job["template"] = case["template"]
    elif "template" in case:
        job["json_schema"] = BUILTIN[case["template"]].json_schema
    else:
        job["json_schema"] = case["schema"]
    return job


def code_job(case: dict[str, Any], suffix: str = "", **extra: Any) -> dict[str, Any]:
    return {
        "id": case["id"] + suffix,
        "type": "codegen",
        "language": "python",
        "instruction": case["instruction"],
        "max_tokens": 256,
        **extra,
    }


def summary_job(case: dict[str, Any], suffix: str = "", **extra: Any) -> dict[str, Any]:
    return {
        "id": case["id"] + suffix,
        "type": "summarize",
        "text": case["text"],
        "max_words": MAX_WORDS,
        **extra,
    }


# -- scoring


def _norm(v: Any) -> Any:
    if isinstance(v, str):
        return " ".join(v.strip().casefold().split())
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


def value_accuracy(expected: dict[str, Any], data: Any) -> tuple[int, int]:
    """(fields right, fields expected)."""
    if not expected:
        return 0, 0
    right = 0
    for key, want in expected.items():
        got = data.get(key) if isinstance(data, dict) else None
        if isinstance(want, list):
            ok = isinstance(got, list) and {_norm(x) for x in got} == {_norm(x) for x in want}
        else:
            ok = _norm(got) == _norm(want)
        right += ok
    return right, len(expected)


def han_share(text: str) -> float:
    letters = [c for c in text if c.isalpha()]
    return sum("\u4e00" <= c <= "\u9fff" for c in letters) / max(len(letters), 1)


def summary_checks(case: dict[str, Any], r: Any) -> dict[str, Any]:
    text = r.text or ""
    zh = case["lang"] == "zh"
    share = han_share(text)
    length = sum("\u4e00" <= c <= "\u9fff" for c in text) / 2 if zh else len(text.split())
    return {
        "language_ok": share > 0.5 if zh else share == 0.0,
        "in_budget": 0 < length <= 1.5 * MAX_WORDS,
        "finish_reason": r.finish_reason,
    }


def run_tests(code: str | None, tests: str) -> bool:
    if not code:
        return False
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(code + "\n\n" + tests + "\n")
    try:
        done = subprocess.run([sys.executable, f.name], capture_output=True, timeout=10)
        return done.returncode == 0
    except subprocess.TimeoutExpired:
        return False
    finally:
        os.unlink(f.name)


def attempts_of(r: Any) -> list[dict[str, Any]]:
    return [a.model_dump() for a in r.attempts]


# -- running


class Worker:
    """One ``vqueue worker`` on the model, on its own queue and key prefix."""

    def __init__(self, a: argparse.Namespace, name: str, **env: str) -> None:
        from producer import Client

        tag = f"q{name}-{uuid.uuid4().hex[:6]}"
        self.env = dict(
            plugin_env(),
            VQUEUE_BROKER_URL=a.redis,
            VQUEUE_QUEUE=tag,
            VQUEUE_KEY_PREFIX=tag,
            VQUEUE_MODEL=a.model,
            VQUEUE_RESULT_CACHE="false",  # each variant answers the same set
            VQUEUE_HEARTBEAT_S="1",
            **env,
        )
        log = Path(a.out) / f"worker-{name}.log"
        self.proc, self.log, self.start_s = launch_worker(
            f"{tag}@quality", self.env, log, a.redis, "-l", "WARNING"
        )
        s = Settings(_env_file=None, broker_url=a.redis, queue=tag, key_prefix=tag)
        self.client = Client(s)

    def run(self, jobs: list[dict[str, Any]]) -> tuple[dict[str, Any], float]:
        t0 = time.perf_counter()
        results = list(self.client.submit_many(jobs).results(timeout=1800))
        return {r.id: r for r in results}, time.perf_counter() - t0

    def close(self) -> None:
        stop(self.proc, self.log, 120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--out", default="")
    ap.add_argument("--results", default="", help="the JSON to write (default: results/)")
    ap.add_argument(
        "--only",
        choices=["codegen", "loops"],
        help="codegen: only the codegen-with-tests set (benchmarks/codegen_set.py); loops: only "
        "the loop cases, on a worker with the default loop check and on one that checks cycles "
        "of up to 32 tokens",
    )
    ap.add_argument("--attempts", type=int, default=3, help="k of pass@k (max_attempts)")
    a = ap.parse_args()
    a.out = a.out or tempfile.mkdtemp(prefix="vqueue-quality-")
    Path(a.out).mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "model": a.model,
        "command": "python -m benchmarks.quality" + (f" --model {a.model}" if a.model else ""),
    }
    print(f"quality: starting a worker on {a.model} (logs in {a.out})", file=sys.stderr)
    if a.only == "codegen":
        codegen_only(a, report)
        return
    if a.only == "loops":
        loops_only(a, report)
        return
    w = Worker(a, "on")
    try:
        # 1. every case, greedy, the worker's defaults (templates, early stop, loop detection)
        jobs = [extract_job(c) for c in EXTRACT + LOOPS]
        jobs += [code_job(c) for c in CODE] + [summary_job(c) for c in SUMMARIES]
        got, wall = w.run(jobs)
        report["normal"] = score(got, wall)
        # 2. the template cases with their schemas bare
        bare = [c for c in EXTRACT if "template" in c]
        got2, _ = w.run([extract_job(c, bare=True, suffix="-bare") for c in bare])
        report["templates"] = templates_table(got, got2, bare)
        # 3. rambling: summaries and code at a high temperature, early stop off and on
        report["rambling"] = {}
        for early in (False, True):
            suffix = "-es" if early else "-noes"
            kw = {"temperature": RAMBLE_TEMPERATURE, "early_stop": early, "seed": 7}
            rj = [summary_job(c, suffix, **kw) for c in SUMMARIES]
            rj += [code_job(c, suffix, **kw) for c in CODE]
            gr, rw = w.run(rj)
            report["rambling"]["on" if early else "off"] = ramble(gr, rw, suffix)
    finally:
        w.close()
    # 4. the loop cases again on a worker without loop detection
    print("quality: a second worker, loop detection off", file=sys.stderr)
    w = Worker(a, "off", VQUEUE_LOOP_DETECTION="off")
    try:
        got3, _ = w.run([extract_job(c) for c in LOOPS])
    finally:
        w.close()
    report["loops"] = loops_table(got, got3)
    out = Path(
        a.results
        or ROOT / "benchmarks" / "results" / f"quality-{Path(a.model).name}-{report['date']}.json"
    )
    out.write_text(json.dumps(report, indent=2, ensure_ascii=False, default=str))
    print_tables(report)
    print(f"wrote {out}", file=sys.stderr)


def codegen_only(a: argparse.Namespace, report: dict[str, Any]) -> None:
    """The codegen-with-tests set through the worker's sandbox: pass@1 and pass@k."""
    from .codegen_set import TASKS, pass_rates, tested_job

    report["command"] += f" --only codegen --attempts {a.attempts}"
    w = Worker(a, "codegen")
    try:
        got, wall = w.run([tested_job(t, a.attempts) for t in TASKS])
    finally:
        w.close()
    report["codegen_tested"] = {**pass_rates(got, a.attempts), "wall_s": round(wall, 1)}
    out = Path(
        a.results
        or ROOT / "benchmarks" / "results"
        / f"quality-codegen-{Path(a.model).name}-{report['date']}.json"
    )  # fmt: skip
    out.write_text(json.dumps(report, indent=2, ensure_ascii=False, default=str))
    c = report["codegen_tested"]
    k = a.attempts
    print(f"| set | tasks | pass@1 | pass@{k} |\n|---|---|---|---|")
    print(f"| all | {c['tasks']} | {c['pass@1']:.0%} | {c[f'pass@{k}']:.0%} |")
    for lang, r in c["by_language"].items():
        n = sum(1 for x in c["rows"] if x["lang"] == lang)
        print(f"| {lang} | {n} | {r['pass@1']:.0%} | {r[f'pass@{k}']:.0%} |")
    print(f"wrote {out}", file=sys.stderr)


def score(got: dict[str, Any], wall: float) -> dict[str, Any]:
    ex = []
    for c in EXTRACT + LOOPS:
        r = got[c["id"]]
        right, total = value_accuracy(c["expected"], r.data)
        ex.append(
            {
                "id": c["id"],
                "lang": c["lang"],
                "status": r.status,
                "error": r.error.type if r.error else None,
                "valid": r.status == "completed",
                "right": right,
                "expected": total,
                "data": r.data,
                "tokens": r.usage.completion_tokens + r.usage.wasted_tokens,
                "attempts": attempts_of(r),
            }
        )
    code = []
    for c in CODE:
        r = got[c["id"]]
        code.append(
            {
                "id": c["id"],
                "passed": run_tests(r.code, c["tests"]),
                "finish_reason": r.finish_reason,
                "code": r.code,
                "attempts": attempts_of(r),
            }
        )
    sums = []
    for c in SUMMARIES:
        r = got[c["id"]]
        sums.append(
            {
                "id": c["id"],
                "lang": c["lang"],
                **summary_checks(c, r),
                "text": r.text,
                "attempts": attempts_of(r),
            }
        )
    every = [x for group in (ex, code, sums) for x in group]
    return {
        "wall_s": wall,
        "extract": ex,
        "code": code,
        "summaries": sums,
        "false_alarms": sum(
            any(t["reason"] == "low_confidence" for t in x["attempts"]) for x in every
        ),
        "loops_caught": sum(any(t["reason"] == "loop" for t in x["attempts"]) for x in every),
    }


def templates_table(
    got: dict[str, Any], bare: dict[str, Any], cases: list[dict[str, Any]]
) -> dict[str, Any]:
    rows = []
    for c in cases:
        a, b = got[c["id"]], bare[c["id"] + "-bare"]
        ra, n = value_accuracy(c["expected"], a.data)
        rb, _ = value_accuracy(c["expected"], b.data)
        rows.append(
            {
                "id": c["id"],
                "expected": n,
                "with_template": ra,
                "bare_schema": rb,
                "valid_with": a.status == "completed",
                "valid_bare": b.status == "completed",
            }
        )
    return {"rows": rows}


def ramble(got: dict[str, Any], wall: float, suffix: str) -> dict[str, Any]:
    rows = []
    for c in SUMMARIES:
        r = got[c["id"] + suffix]
        rows.append({"id": c["id"], "kind": "summary", **summary_checks(c, r), **_spent(r)})
    for c in CODE:
        r = got[c["id"] + suffix]
        rows.append({"id": c["id"], "kind": "code", "passed": run_tests(r.code, c["tests"])})
        rows[-1].update(_spent(r))
    return {
        "wall_s": wall,
        "tokens": sum(x["tokens"] for x in rows),
        "aborted_attempts": sum(x["aborts"] for x in rows),
        "jobs_with_an_abort": sum(x["aborts"] > 0 for x in rows),
        "summaries_language_ok": sum(x.get("language_ok", False) for x in rows),
        "summaries_in_budget": sum(x.get("in_budget", False) for x in rows),
        "code_passed": sum(x.get("passed", False) for x in rows),
        "rows": rows,
    }


def _spent(r: Any) -> dict[str, Any]:
    return {
        "tokens": r.usage.completion_tokens + r.usage.wasted_tokens,
        "aborts": sum(a.reason == "low_confidence" for a in r.attempts),
        "low_confidence": r.low_confidence,
        "finish_reason": r.finish_reason,
    }


def loops_table(on: dict[str, Any], off: dict[str, Any], other: str = "without") -> dict[str, Any]:
    def side(r: Any, c: dict[str, Any]) -> dict[str, Any]:
        looped = [t for t in r.attempts if t.reason == "loop"]
        return {
            "status": r.status,
            "error": r.error.type if r.error else None,
            "loops": len(looped),
            # the first looped run's tokens: under its max_tokens, the engine ended it
            "first_loop_tokens": looped[0].tokens if looped else None,
            "tokens": r.usage.completion_tokens + r.usage.wasted_tokens,
            "right": value_accuracy(c["expected"], r.data)[0],
        }

    rows = [
        {"id": c["id"], "with_detection": side(on[c["id"]], c), other: side(off[c["id"]], c),
         "expected": len(c["expected"])}
        for c in LOOPS
    ]  # fmt: skip
    return {"rows": rows}


def loops_only(a: argparse.Namespace, report: dict[str, Any]) -> None:
    """The loop cases on a worker with the default loop check and on one whose check covers
    cycles of up to 32 tokens: which loops the engine ends, after how many tokens."""
    report["command"] += " --only loops"
    got = {}
    for name, env in (("default", {}), ("32", {"VQUEUE_LOOP_MAX_CYCLE_TOKENS": "32"})):
        w = Worker(a, f"loops-{name}", **env)
        try:
            got[name], _ = w.run([extract_job(c) for c in LOOPS])
            report.setdefault("loop_check", {})[name] = _plan_of(w)
        finally:
            w.close()
    report["loops"] = loops_table(got["default"], got["32"], "cycles_up_to_32")
    name = f"quality-loops-{Path(a.model).name}-{report['date']}.json"
    out = Path(a.results or ROOT / "benchmarks" / "results" / name)
    out.write_text(json.dumps(report, indent=2, ensure_ascii=False, default=str))
    print("| case | default: outcome, loops, first loop's tokens, tokens | up to 32: the same |")
    print("|---|---|---|")
    for row in report["loops"]["rows"]:
        cells = [row["with_detection"], row["cycles_up_to_32"]]
        print(f"| {row['id']} | " + " | ".join(
            f"{x['error'] or x['status']}, {x['loops']}, {x['first_loop_tokens'] or '-'}, "
            f"{x['tokens']:,}" for x in cells) + " |")  # fmt: skip
    print(f"wrote {out}", file=sys.stderr)


def _plan_of(w: Worker) -> Any:
    """The worker's engine plan's loop check, from its heartbeat (``vqueue status``)."""
    for info in w.client.store.workers():
        return (info.get("engine") or {}).get("loop_check")
    return None


def print_tables(r: dict[str, Any]) -> None:
    n = r["normal"]
    ex = n["extract"]
    for lang in ("en", "zh"):
        mine = [x for x in ex if x["lang"] == lang]
        right = sum(x["right"] for x in mine)
        total = sum(x["expected"] for x in mine)
        print(
            f"| extraction ({lang}) | {sum(x['valid'] for x in mine)}/{len(mine)} valid | "
            f"{right}/{total} values right |"
        )
    code = n["code"]
    print(f"| code | {sum(x['passed'] for x in code)}/{len(code)} pass their tests | |")
    for lang in ("en", "zh"):
        mine = [x for x in n["summaries"] if x["lang"] == lang]
        print(
            f"| summaries ({lang}) | {sum(x['language_ok'] for x in mine)}/{len(mine)} in the "
            f"language | {sum(x['in_budget'] for x in mine)}/{len(mine)} within budget; finish "
            f"{sorted({str(x['finish_reason']) for x in mine})} |"
        )
    print(f"| early stop, greedy | {n['false_alarms']} false alarms | |")
    print(f"| loops caught, greedy | {n['loops_caught']} | |")
    print("\n| case | fields | with template | bare schema |\n|---|---|---|---|")
    for x in r["templates"]["rows"]:
        print(f"| {x['id']} | {x['expected']} | {x['with_template']} | {x['bare_schema']} |")
    print(
        "\n| loop case | with detection: status, loops, tokens | without: status, tokens |"
        "\n|---|---|---|"
    )
    for x in r["loops"]["rows"]:
        a, b = x["with_detection"], x["without"]
        print(
            f"| {x['id']} | {a['error'] or a['status']}, {a['loops']}, {a['tokens']} | "
            f"{b['error'] or b['status']}, {b['tokens']} |"
        )
    print(
        f"\n| T={RAMBLE_TEMPERATURE} | jobs with an abort | tokens | seconds | summaries in "
        "language / budget | code passed |\n|---|---|---|---|---|---|"
    )
    for k, v in r["rambling"].items():
        print(
            f"| early stop {k} | {v['jobs_with_an_abort']} | {v['tokens']} | {v['wall_s']:.1f} | "
            f"{v['summaries_language_ok']} / {v['summaries_in_budget']} | {v['code_passed']} |"
        )


if __name__ == "__main__":
    main()
