"""Codegen tasks with tests, for ``benchmarks/quality.py --only codegen``: each a Python function
asked for in English or in Chinese, and the asserts a right answer passes. The worker runs each
answer against its tests in its sandbox and answers again until one passes (``max_attempts``):
pass@1 is the share whose first answer passed, pass@k the share with any answer passing."""

from __future__ import annotations

from typing import Any

# (id, language of the instruction, instruction, tests)
_TASKS: list[tuple[str, str, str, str]] = [
    (
        "add",
        "en",
        "Write a Python function add(a, b) that returns the sum of a and b.",
        "assert add(2, 3) == 5\nassert add(-1, 1) == 0",
    ),
    (
        "is_even",
        "en",
        "Write a Python function is_even(n) that returns True when the integer n is even and Fa"
        "lse otherwise.",
        "assert is_even(4) is True\nassert is_even(7) is False",
    ),
    (
        "reverse",
        "en",
        "Write a Python function reverse_string(s) that returns the string s reversed.",
        "assert reverse_string('abc') == 'cba'\nassert reverse_string('') == ''",
    ),
    (
        "largest",
        "en",
        "Write a Python function largest(xs) that returns the largest number in the non-empty l"
        "ist xs.",
        "assert largest([3, 9, 2]) == 9\nassert largest([-5]) == -5",
    ),
    (
        "factorial",
        "en",
        "Write a Python function factorial(n) that returns n! for n >= 0.",
        "assert factorial(0) == 1\nassert factorial(5) == 120",
    ),
    (
        "count_vowels",
        "en",
        "Write a Python function count_vowels(s) that returns how many of the letters a, e, i, "
        "o, u (either case) the string s contains.",
        "assert count_vowels('Hello') == 2\nassert count_vowels('xyz') == 0",
    ),
    (
        "is_palindrome",
        "en",
        "Write a Python function is_palindrome(s) that returns True when the string s reads the"
        " same backwards, else False.",
        "assert is_palindrome('level') is True\nassert is_palindrome('abc') is False",
    ),
    (
        "fib",
        "en",
        "Write a Python function fib(n) that returns the n-th Fibonacci number, with fib(0) == "
        "0 and fib(1) == 1.",
        "assert fib(0) == 0\nassert fib(1) == 1\nassert fib(10) == 55",
    ),
    (
        "sum_list",
        "en",
        "Write a Python function sum_list(xs) that returns the sum of the numbers in the list x"
        "s (0 for an empty list).",
        "assert sum_list([1, 2, 3]) == 6\nassert sum_list([]) == 0",
    ),
    (
        "square_all",
        "en",
        "Write a Python function square_all(xs) that returns a new list with each number of xs "
        "squared.",
        "assert square_all([1, 2, 3]) == [1, 4, 9]\nassert square_all([]) == []",
    ),
    (
        "count_words",
        "en",
        "Write a Python function count_words(s) that returns the number of words in the string "
        "s, words being separated by whitespace.",
        "assert count_words('a b  c') == 3\nassert count_words('') == 0",
    ),
    (
        "gcd",
        "en",
        "Write a Python function gcd(a, b) that returns the greatest common divisor of two posi"
        "tive integers.",
        "assert gcd(12, 18) == 6\nassert gcd(7, 5) == 1",
    ),
    (
        "unique",
        "en",
        "Write a Python function unique(xs) that returns the items of the list xs without repea"
        "ts, in the order they first appear.",
        "assert unique([3, 1, 3, 2, 1]) == [3, 1, 2]\nassert unique([]) == []",
    ),
    (
        "celsius",
        "en",
        "Write a Python function to_fahrenheit(c) that converts a temperature in degrees Celsiu"
        "s to degrees Fahrenheit.",
        "assert to_fahrenheit(0) == 32\nassert to_fahrenheit(100) == 212",
    ),
    (
        "is_prime",
        "en",
        "Write a Python function is_prime(n) that returns True when the integer n is a prime nu"
        "mber, else False.",
        "assert is_prime(2) and is_prime(13)\nassert not is_prime(1) and not is_prime(15)",
    ),
    (
        "add_zh",
        "zh",
        "编写一个 Python 函数 add(a, b)，返回 a 与 b 的和。",
        "assert add(2, 3) == 5\nassert add(-1, 1) == 0",
    ),
    (
        "is_even_zh",
        "zh",
        "编写一个 Python 函数 is_even(n)：整数 n 为偶数时返回 True，否则返回 False。",
        "assert is_even(4) is True\nassert is_even(7) is False",
    ),
    (
        "reverse_zh",
        "zh",
        "编写一个 Python 函数 reverse_string(s)，返回字符串 s 的反转。",
        "assert reverse_string('abc') == 'cba'\nassert reverse_string('') == ''",
    ),
    (
        "largest_zh",
        "zh",
        "编写一个 Python 函数 largest(xs)，返回非空列表 xs 中最大的数。",
        "assert largest([3, 9, 2]) == 9\nassert largest([-5]) == -5",
    ),
    (
        "factorial_zh",
        "zh",
        "编写一个 Python 函数 factorial(n)，对 n >= 0 返回 n 的阶乘。",
        "assert factorial(0) == 1\nassert factorial(5) == 120",
    ),
    (
        "count_vowels_zh",
        "zh",
        "编写一个 Python 函数 count_vowels(s)，返回字符串 s 中字母 a、e、i、o、u（不区分大小写"
        "）出现的次数。",
        "assert count_vowels('Hello') == 2\nassert count_vowels('xyz') == 0",
    ),
    (
        "is_palindrome_zh",
        "zh",
        "编写一个 Python 函数 is_palindrome(s)：字符串 s 正读反读相同时返回 True，否则返回 False。",
        "assert is_palindrome('level') is True\nassert is_palindrome('abc') is False",
    ),
    (
        "fib_zh",
        "zh",
        "编写一个 Python 函数 fib(n)，返回第 n 个斐波那契数，其中 fib(0) == 0，fib(1) == 1。",
        "assert fib(0) == 0\nassert fib(1) == 1\nassert fib(10) == 55",
    ),
    (
        "sum_list_zh",
        "zh",
        "编写一个 Python 函数 sum_list(xs)，返回列表 xs 中所有数的和（空列表返回 0）。",
        "assert sum_list([1, 2, 3]) == 6\nassert sum_list([]) == 0",
    ),
    (
        "square_all_zh",
        "zh",
        "编写一个 Python 函数 square_all(xs)，返回一个新列表，其中每个元素是 xs 中对应数的平方。",
        "assert square_all([1, 2, 3]) == [1, 4, 9]\nassert square_all([]) == []",
    ),
    (
        "count_words_zh",
        "zh",
        "编写一个 Python 函数 count_words(s)，返回字符串 s 中以空白分隔的单词个数。",
        "assert count_words('a b  c') == 3\nassert count_words('') == 0",
    ),
    (
        "gcd_zh",
        "zh",
        "编写一个 Python 函数 gcd(a, b)，返回两个正整数的最大公约数。",
        "assert gcd(12, 18) == 6\nassert gcd(7, 5) == 1",
    ),
    (
        "unique_zh",
        "zh",
        "编写一个 Python 函数 unique(xs)，按首次出现的顺序返回列表 xs 中不重复的元素。",
        "assert unique([3, 1, 3, 2, 1]) == [3, 1, 2]\nassert unique([]) == []",
    ),
    (
        "celsius_zh",
        "zh",
        "编写一个 Python 函数 to_fahrenheit(c)，把摄氏温度 c 转换为华氏温度。",
        "assert to_fahrenheit(0) == 32\nassert to_fahrenheit(100) == 212",
    ),
    (
        "is_prime_zh",
        "zh",
        "编写一个 Python 函数 is_prime(n)：整数 n 是质数时返回 True，否则返回 False。",
        "assert is_prime(2) and is_prime(13)\nassert not is_prime(1) and not is_prime(15)",
    ),
]

TASKS: list[dict[str, Any]] = [
    {"id": i, "lang": lang, "instruction": text, "tests": tests} for i, lang, text, tests in _TASKS
]


def tested_job(task: dict[str, Any], attempts: int, max_tokens: int = 256) -> dict[str, Any]:
    """The task as a codegen job the worker checks against its tests, answering again up to
    ``attempts`` times."""
    return {
        "id": f"t-{task['id']}",
        "type": "codegen",
        "language": "python",
        "instruction": task["instruction"],
        "tests": task["tests"],
        "max_attempts": attempts,
        "max_tokens": max_tokens,
    }


def pass_rates(results: dict[str, Any], attempts: int) -> dict[str, Any]:
    """pass@1 and pass@k over the tasks, overall and per instruction language, from the
    results' ``tests`` reports (``k`` = ``attempts``)."""
    rows = []
    for t in TASKS:
        r = results[f"t-{t['id']}"]
        runs = r.tests.attempts if r.tests else []
        rows.append({
            "id": t["id"],
            "lang": t["lang"],
            "status": r.status,
            "error": r.error.type if r.error else None,
            "first": bool(runs) and runs[0].outcome == "passed",
            "any": bool(r.tests and r.tests.passed),
            "attempts": [(a.outcome, a.detail) for a in runs],
        })  # fmt: skip

    def rate(key: str, lang: str | None = None) -> float:
        sel = [x for x in rows if lang is None or x["lang"] == lang]
        return sum(x[key] for x in sel) / len(sel) if sel else 0.0

    return {
        "tasks": len(rows),
        "k": attempts,
        "pass@1": rate("first"),
        f"pass@{attempts}": rate("any"),
        "by_language": {
            lang: {"pass@1": rate("first", lang), f"pass@{attempts}": rate("any", lang)}
            for lang in ("en", "zh")
        },
        "rows": rows,
    }
