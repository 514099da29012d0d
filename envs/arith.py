"""A safe evaluator for the arithmetic a Countdown answer may contain.

RAGEN scores Countdown answers with Python's ``eval`` (builtins removed) behind a character regex.
That still lets a policy write ``9**9**9`` (the regex admits ``*``) and hang a rollout worker, and
any slip in the regex would hand code execution to a model under RL pressure. We replace it with
this module (docs/architecture.md, "Deliberate differences from RAGEN": Countdown scoring): a
hand-written tokenizer and recursive-descent parser over a tiny grammar, exact rational arithmetic
(:class:`fractions.Fraction`, so ``6 / 4 * 2`` is exactly 3 and no float tolerance is needed), and
hard limits that bound the work on any input.

Grammar (usual precedence, left-associative binary operators)::

    expr    := term (('+' | '-') term)*
    term    := unary (('*' | '/') unary)*
    unary   := ('+' | '-') unary | primary
    primary := INTEGER | '(' expr ')'

* ``INTEGER`` is a run of ASCII digits ``0-9`` without leading zeros (``0`` itself is fine), as in
  Python source. Non-ASCII digits (``'٣'``, full-width ``'３'``) are rejected: ``int()`` would
  accept them, which is exactly why literals are converted only after the ASCII check.
* Whitespace is ASCII space, tab, CR and LF. Anything else (letters, ``.``, ``=``, ``**``, ``//``,
  ``^``, NUL, ...) is an error.
* Limits: :data:`MAX_LENGTH` characters (checked before anything else, so a 1 MB string costs one
  ``len``), :data:`MAX_TOKENS` tokens, :data:`MAX_DIGITS` digits per literal, :data:`MAX_DEPTH`
  nested parentheses / unary signs, :data:`MAX_BITS` bits in any intermediate numerator or
  denominator. Division by zero is an error.

Every failure is an :class:`ArithError`; nothing else escapes :func:`evaluate` for ``str`` input.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

MAX_LENGTH = 1000
"""Longest accepted input, in characters. A Countdown equation needs a few dozen."""

MAX_TOKENS = 256
"""Most tokens (literals, operators, parentheses) in one expression."""

MAX_DIGITS = 32
"""Most digits in one integer literal."""

MAX_DEPTH = 32
"""Deepest nesting of parentheses and unary signs (bounds the parser's recursion)."""

MAX_BITS = 4096
"""Largest bit length of an intermediate numerator or denominator (bounds the cost of Fractions)."""

_DIGITS = frozenset("0123456789")
_OPERATORS = frozenset("+-*/()")
_WHITESPACE = frozenset(" \t\r\n")

Token = int | str
"""A token is an integer literal (``int``) or one of the characters ``+ - * / ( )``."""


class ArithError(ValueError):
    """The text is not a well-formed integer arithmetic expression within the limits."""


@dataclass(frozen=True)
class Evaluation:
    """The exact value of an expression and the integer literals it used, in reading order."""

    value: Fraction
    numbers: tuple[int, ...]


def integers_in(text: str) -> list[int]:
    """Every maximal run of ASCII digits in ``text``, as integers, in order.

    This is RAGEN's number check (``re.findall(r"\\d+")``) restricted to ASCII digits: Python's
    ``\\d`` also matches other scripts' digits, which ``int()`` would then silently convert. Used to
    compare an answer's numbers with the puzzle's even when the answer does not parse.
    """
    found: list[int] = []
    start = -1
    for i, ch in enumerate(text):
        if ch in _DIGITS:
            if start < 0:
                start = i
        elif start >= 0:
            found.append(int(text[start:i]))
            start = -1
    if start >= 0:
        found.append(int(text[start:]))
    return found


def tokenize(text: str, *, max_length: int = MAX_LENGTH, max_tokens: int = MAX_TOKENS) -> list[Token]:
    """Split ``text`` into integer literals and operator characters, enforcing the limits."""
    if not isinstance(text, str):
        raise ArithError(f"expression must be a str, not {type(text).__name__}")
    if len(text) > max_length:
        raise ArithError(f"expression longer than {max_length} characters")
    tokens: list[Token] = []
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch in _WHITESPACE:
            i += 1
            continue
        if ch in _DIGITS:
            j = i + 1
            while j < n and text[j] in _DIGITS:
                j += 1
            literal = text[i:j]
            if len(literal) > MAX_DIGITS:
                raise ArithError(f"integer literal longer than {MAX_DIGITS} digits at position {i}")
            if len(literal) > 1 and literal[0] == "0":
                raise ArithError(f"integer literal with a leading zero at position {i}: {literal!r}")
            tokens.append(int(literal))  # ASCII digits only, so int() cannot be surprised
            i = j
        elif ch in _OPERATORS:
            tokens.append(ch)
            i += 1
        else:
            raise ArithError(f"unexpected character {ch!r} at position {i}")
        if len(tokens) > max_tokens:
            raise ArithError(f"expression has more than {max_tokens} tokens")
    return tokens


class _Parser:
    """Recursive descent over a token list; one instance per expression (no shared state)."""

    def __init__(self, tokens: list[Token], max_depth: int) -> None:
        self.tokens = tokens
        self.pos = 0
        self.depth = 0
        self.max_depth = max_depth
        self.numbers: list[int] = []

    def peek(self) -> Token | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def parse(self) -> Fraction:
        if not self.tokens:
            raise ArithError("empty expression")
        value = self.expr()
        if self.pos != len(self.tokens):
            raise ArithError(f"unexpected token {self.tokens[self.pos]!r} after a complete expression")
        return value

    def expr(self) -> Fraction:
        value = self.term()
        while (tok := self.peek()) in ("+", "-"):
            self.pos += 1
            rhs = self.term()
            value = _checked(value + rhs if tok == "+" else value - rhs)
        return value

    def term(self) -> Fraction:
        value = self.unary()
        while (tok := self.peek()) in ("*", "/"):
            self.pos += 1
            rhs = self.unary()
            if tok == "*":
                value = _checked(value * rhs)
            else:
                if rhs == 0:
                    raise ArithError("division by zero")
                value = _checked(value / rhs)
        return value

    def unary(self) -> Fraction:
        tok = self.peek()
        if tok in ("+", "-"):
            self.pos += 1
            self.enter()
            value = self.unary()
            self.depth -= 1
            return -value if tok == "-" else value
        return self.primary()

    def primary(self) -> Fraction:
        tok = self.peek()
        if isinstance(tok, int):
            self.pos += 1
            self.numbers.append(tok)
            return Fraction(tok)
        if tok == "(":
            self.pos += 1
            self.enter()
            value = self.expr()
            if self.peek() != ")":
                raise ArithError("missing closing parenthesis")
            self.pos += 1
            self.depth -= 1
            return value
        if tok is None:
            raise ArithError("expression ends where a number was expected")
        raise ArithError(f"unexpected token {tok!r} where a number was expected")

    def enter(self) -> None:
        self.depth += 1
        if self.depth > self.max_depth:
            raise ArithError(f"expression nested deeper than {self.max_depth} levels")


def _checked(value: Fraction) -> Fraction:
    if value.numerator.bit_length() > MAX_BITS or value.denominator.bit_length() > MAX_BITS:
        raise ArithError(f"intermediate value larger than {MAX_BITS} bits")
    return value


def evaluate(
    text: str,
    *,
    max_length: int = MAX_LENGTH,
    max_tokens: int = MAX_TOKENS,
    max_depth: int = MAX_DEPTH,
) -> Evaluation:
    """Evaluate ``text`` exactly; raise :class:`ArithError` for anything that is not a valid expression."""
    tokens = tokenize(text, max_length=max_length, max_tokens=max_tokens)
    parser = _Parser(tokens, max_depth)
    value = parser.parse()
    return Evaluation(value=value, numbers=tuple(parser.numbers))


def try_evaluate(text: str, **limits: int) -> Evaluation | None:
    """:func:`evaluate`, or ``None`` where it would raise :class:`ArithError`."""
    try:
        return evaluate(text, **limits)
    except ArithError:
        return None
