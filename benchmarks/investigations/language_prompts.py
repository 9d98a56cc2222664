"""Which instruction makes a small model answer in the document's language (docs/quality.md).

    .venv/bin/python -m benchmarks.investigations.language_prompts [--model PATH]

vLLM offline, greedy, the worker's summarize system prompt; two Chinese texts, one English, one
French, each under five instructions. Counts a Chinese text answered in Chinese when more than
half the answer's letters are Han characters; for English and French prints the answer's start
to read. Prints a table and writes benchmarks/results/language-prompts-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOCS = {
    "zh flood": (
        "受持续强降雨影响，本市多条河流水位上涨，防汛部门已启动三级应急响应。"
        "市气象台预计未来三天仍有大到暴雨，请市民减少外出，注意防范山洪和城市内涝。"
        "目前已转移群众一千二百余人，暂无人员伤亡报告。"
    ),
    "zh earnings": (
        "公司第三季度营收同比增长百分之十二，达到四十五亿元，主要得益于海外市场的快速扩张。"
        "管理层表示，将继续加大研发投入，并计划在明年推出两款新产品。"
    ),
    "en": (
        "Heavy rain has raised river levels across the city, and the flood agency has started a "
        "level-three emergency response. Forecasters expect more storms over the next three "
        "days; residents are asked to stay indoors. About 1,200 people have been moved and no "
        "casualties are reported."
    ),
    "fr": (
        "De fortes pluies ont fait monter le niveau des rivières dans toute la ville, et le "
        "service des crues a déclenché une réponse d'urgence de niveau trois. Environ 1 200 "
        "personnes ont été évacuées et aucune victime n'est signalée."
    ),
}
NAMES = {"zh flood": "Chinese", "zh earnings": "Chinese", "en": "English", "fr": "French"}
ASKS = {
    "plain (before)": "Summarize the following text.\n\n{doc}",
    "in the language it is written in": "Summarize the following text in the language it is "
    "written in.\n\n{doc}",
    "same language as the text": "Summarize the following text. Write the summary in the same "
    "language as the text.\n\n{doc}",
    "named, before the text": "Summarize the following text. Write the summary in {lang}.\n\n{doc}",
    "named, after the text (vqueue)": "Summarize the following text.\n\n{doc}\n\nWrite the "
    "summary in {lang}.",
}


def han_share(text: str) -> float:
    letters = [c for c in text if c.isalpha()]
    return sum("\u4e00" <= c <= "\u9fff" for c in letters) / max(len(letters), 1)


def main() -> None:
    from vllm import LLM, SamplingParams

    from schemas import Settings
    from worker.models import resolve_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    path = resolve_model(a.model)
    llm = LLM(
        model=path,
        dtype="float32",
        enforce_eager=True,
        max_model_len=2048,
        kv_cache_memory_bytes=512 * 1024**2,
    )
    system = Settings(_env_file=None).system_prompt("summarize")
    keys = [(ask, doc) for ask in ASKS for doc in DOCS]
    chats = [
        [
            {"role": "system", "content": system},
            {"role": "user", "content": ASKS[ask].format(doc=DOCS[doc], lang=NAMES[doc])},
        ]
        for ask, doc in keys
    ]
    outs = llm.chat(chats, SamplingParams(max_tokens=80, temperature=0.0), use_tqdm=False)
    rows: list[dict[str, Any]] = []
    for (ask, doc), o in zip(keys, outs, strict=True):
        text = o.outputs[0].text
        rows.append(
            {
                "instruction": ask,
                "document": doc,
                "han_share": han_share(text),
                "answer": text[:200],
            }
        )
    print(
        "| instruction | Chinese texts in Chinese | English text, answer starts | French text, "
        "answer starts |\n|---|---|---|---|"
    )
    for ask in ASKS:
        mine = {r["document"]: r for r in rows if r["instruction"] == ask}
        zh = sum(mine[d]["han_share"] > 0.5 for d in ("zh flood", "zh earnings"))
        en, fr = (mine[d]["answer"][:40].replace("\n", " ").replace("|", "/") for d in ("en", "fr"))
        print(f"| {ask} | {zh} of 2 | {en} | {fr} |")
    date = time.strftime("%Y-%m-%d")
    out = Path(a.out or ROOT / "benchmarks" / "results" / f"language-prompts-{date}.json")
    out.write_text(
        json.dumps({"date": date, "model": a.model, "rows": rows}, indent=2, ensure_ascii=False)
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
