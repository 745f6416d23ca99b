"""Assert-style coding problems for the code reward's tests: a reference solution each, the same
solution with one planted bug, and the asserts (the dataset's test cases)."""

from __future__ import annotations

from typing import NamedTuple


class Problem(NamedTuple):
    name: str
    solution: str
    buggy: str
    asserts: list[str]


PROBLEMS = [
    Problem(
        "add",
        "def add(a, b):\n    return a + b",
        "def add(a, b):\n    return a - b",
        ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(10, 5) == 15"],
    ),
    Problem(
        "factorial",
        "def factorial(n):\n    r = 1\n    for i in range(2, n + 1):\n        r *= i\n    return r",
        "def factorial(n):\n    r = 1\n    for i in range(2, n):\n        r *= i\n    return r",
        [
            "assert factorial(0) == 1",
            "assert factorial(5) == 120",
            "assert factorial(10) == 3628800",
        ],
    ),
    Problem(
        "fibonacci",
        "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
        "def fib(n):\n    a, b = 1, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
        ["assert fib(0) == 0", "assert fib(1) == 1", "assert fib(10) == 55"],
    ),
    Problem(
        "is_prime",
        "def is_prime(n):\n    if n < 2:\n        return False\n"
        "    return all(n % d for d in range(2, int(n ** 0.5) + 1))",
        "def is_prime(n):\n    if n < 2:\n        return False\n"
        "    return all(n % d for d in range(2, int(n ** 0.5)))",
        [
            "assert is_prime(2)",
            "assert not is_prime(9)",
            "assert is_prime(97)",
            "assert not is_prime(1)",
        ],
    ),
    Problem(
        "reverse_string",
        "def reverse(s):\n    return s[::-1]",
        "def reverse(s):\n    return s[:0:-1]",
        [
            "assert reverse('abc') == 'cba'",
            "assert reverse('') == ''",
            "assert reverse('a') == 'a'",
        ],
    ),
    Problem(
        "is_palindrome",
        "def is_palindrome(s):\n    t = ''.join(c.lower() for c in s if c.isalnum())\n"
        "    return t == t[::-1]",
        "def is_palindrome(s):\n    t = ''.join(c for c in s if c.isalnum())\n    return t == t[::-1]",
        [
            "assert is_palindrome('A man, a plan, a canal: Panama')",
            "assert not is_palindrome('hello')",
            "assert is_palindrome('')",
        ],
    ),
    Problem(
        "count_vowels",
        "def count_vowels(s):\n    return sum(c in 'aeiouAEIOU' for c in s)",
        "def count_vowels(s):\n    return sum(c in 'aeiou' for c in s)",
        ["assert count_vowels('Apple') == 2", "assert count_vowels('xyz') == 0"],
    ),
    Problem(
        "max_of_list",
        "def max_of(xs):\n    best = xs[0]\n    for x in xs:\n        if x > best:\n"
        "            best = x\n    return best",
        "def max_of(xs):\n    best = 0\n    for x in xs:\n        if x > best:\n"
        "            best = x\n    return best",
        ["assert max_of([3, 1, 2]) == 3", "assert max_of([-5, -2, -9]) == -2"],
    ),
    Problem(
        "flatten",
        "def flatten(xs):\n    out = []\n    for x in xs:\n"
        "        out.extend(flatten(x) if isinstance(x, list) else [x])\n    return out",
        "def flatten(xs):\n    out = []\n    for x in xs:\n"
        "        out.extend(x if isinstance(x, list) else [x])\n    return out",
        ["assert flatten([1, [2, [3, 4]], 5]) == [1, 2, 3, 4, 5]", "assert flatten([]) == []"],
    ),
    Problem(
        "gcd",
        "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a",
        "def gcd(a, b):\n    while b > 1:\n        a, b = b, a % b\n    return a",
        ["assert gcd(12, 18) == 6", "assert gcd(17, 5) == 1", "assert gcd(0, 7) == 7"],
    ),
    Problem(
        "binary_search",
        "def search(xs, t):\n    lo, hi = 0, len(xs) - 1\n    while lo <= hi:\n"
        "        mid = (lo + hi) // 2\n        if xs[mid] == t:\n            return mid\n"
        "        if xs[mid] < t:\n            lo = mid + 1\n        else:\n            hi = mid - 1\n"
        "    return -1",
        "def search(xs, t):\n    lo, hi = 0, len(xs) - 1\n    while lo < hi:\n"
        "        mid = (lo + hi) // 2\n        if xs[mid] == t:\n            return mid\n"
        "        if xs[mid] < t:\n            lo = mid + 1\n        else:\n            hi = mid - 1\n"
        "    return -1",
        [
            "assert search([1, 3, 5, 7], 7) == 3",
            "assert search([1, 3, 5, 7], 4) == -1",
            "assert search([2], 2) == 0",
        ],
    ),
    Problem(
        "merge_sorted",
        "def merge(a, b):\n    return sorted(a + b)",
        "def merge(a, b):\n    return sorted(set(a + b))",
        ["assert merge([1, 3], [2, 3]) == [1, 2, 3, 3]", "assert merge([], [1]) == [1]"],
    ),
    Problem(
        "word_count",
        "def word_count(s):\n    out = {}\n    for w in s.split():\n"
        "        out[w] = out.get(w, 0) + 1\n    return out",
        "def word_count(s):\n    out = {}\n    for w in s.split():\n        out[w] = 1\n    return out",
        ["assert word_count('a b a') == {'a': 2, 'b': 1}", "assert word_count('') == {}"],
    ),
    Problem(
        "two_sum",
        "def two_sum(xs, t):\n    seen = {}\n    for i, x in enumerate(xs):\n"
        "        if t - x in seen:\n            return (seen[t - x], i)\n        seen[x] = i\n"
        "    return None",
        "def two_sum(xs, t):\n    seen = {}\n    for i, x in enumerate(xs):\n"
        "        if t - x in seen:\n            return (i, seen[t - x])\n        seen[x] = i\n"
        "    return None",
        ["assert two_sum([2, 7, 11], 9) == (0, 1)", "assert two_sum([1, 2], 10) is None"],
    ),
    Problem(
        "unique_sorted",
        "def unique_sorted(xs):\n    return sorted(set(xs))",
        "def unique_sorted(xs):\n    return sorted(xs)",
        [
            "assert unique_sorted([3, 1, 3, 2]) == [1, 2, 3]",
            "assert unique_sorted([5, 4]) == [4, 5]",
        ],
    ),
    Problem(
        "caesar",
        "def caesar(s, k):\n    return ''.join(chr((ord(c) - 97 + k) % 26 + 97) for c in s)",
        "def caesar(s, k):\n    return ''.join(chr((ord(c) - 97 + k) % 25 + 97) for c in s)",
        ["assert caesar('abc', 1) == 'bcd'", "assert caesar('xyz', 3) == 'abc'"],
    ),
    Problem(
        "roman_to_int",
        "def roman(s):\n    v = {'I': 1, 'V': 5, 'X': 10, 'L': 50, 'C': 100, 'D': 500, 'M': 1000}\n"
        "    total = 0\n    for a, b in zip(s, s[1:] + ' '):\n"
        "        total += -v[a] if b != ' ' and v[a] < v[b] else v[a]\n    return total",
        "def roman(s):\n    v = {'I': 1, 'V': 5, 'X': 10, 'L': 50, 'C': 100, 'D': 500, 'M': 1000}\n"
        "    return sum(v[c] for c in s)",
        ["assert roman('III') == 3", "assert roman('IX') == 9", "assert roman('MCMXCIV') == 1994"],
    ),
    Problem(
        "anagram",
        "def is_anagram(a, b):\n    return sorted(a) == sorted(b)",
        "def is_anagram(a, b):\n    return set(a) == set(b)",
        ["assert is_anagram('listen', 'silent')", "assert not is_anagram('aab', 'abb')"],
    ),
    Problem(
        "rotate",
        "def rotate(xs, k):\n    if not xs:\n        return []\n    k %= len(xs)\n"
        "    return xs[-k:] + xs[:-k]",
        "def rotate(xs, k):\n    if not xs:\n        return []\n    return xs[-k:] + xs[:-k]",
        [
            "assert rotate([1, 2, 3, 4], 1) == [4, 1, 2, 3]",
            "assert rotate([1, 2, 3], 4) == [3, 1, 2]",
        ],
    ),
    Problem(
        "transpose",
        "def transpose(m):\n    return [list(r) for r in zip(*m)]",
        "def transpose(m):\n    return [list(r) for r in m]",
        [
            "assert transpose([[1, 2], [3, 4]]) == [[1, 3], [2, 4]]",
            "assert transpose([[1, 2, 3]]) == [[1], [2], [3]]",
        ],
    ),
    Problem(
        "mean",
        "def mean(xs):\n    return sum(xs) / len(xs)",
        "def mean(xs):\n    return sum(xs) // len(xs)",
        ["assert abs(mean([1, 2]) - 1.5) < 1e-9", "assert mean([2, 4, 6]) == 4"],
    ),
]
