"""A safe arithmetic calculator and the environment that lends it to the model.

`Calculator` evaluates `+ - * / // % **`, unary signs and parentheses over integer and float
literals by walking Python's AST: nothing is `eval`ed, names, calls and attributes are
rejected, and sizes are bounded before they are computed (expression length, integer digits,
exponent), so `9**9**9` is an error, not a hung worker. Errors are `CalculatorError`s, which
`CalculatorEnv` shows the model as a failed tool call.
"""

from __future__ import annotations

import ast
import math
import operator
from dataclasses import dataclass

from .tool_env import ToolEnv, ToolResult, ToolSyntax

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}

# `<calc>2+3</calc>` answered by `<result>5</result>`: for tokenizers with a rich vocabulary.
TAG_SYNTAX = ToolSyntax("<calc>", "</calc>", "<result>", "</result>")
# The tiny character tokenizer has no `<`, `>` or `/`: `calc:2+3#` answered by `result:5\n`,
# with `#` (one token) as the turn's stop token.
TINY_SYNTAX = ToolSyntax("calc:", "#", "result:", "\n")


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate; the message is for the model."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Calculator:
    max_chars: int = 256  # expression length
    max_digits: int = 100  # integer operands and results
    max_exponent: int = 1000  # |exponent| of `**`

    def __call__(self, expression: str) -> int | float:
        expression = expression.strip()
        if not expression:
            raise CalculatorError("empty expression")
        if len(expression) > self.max_chars:
            raise CalculatorError(f"expression longer than {self.max_chars} characters")
        try:
            tree = ast.parse(expression, mode="eval")
        except (SyntaxError, ValueError, MemoryError, RecursionError):
            raise CalculatorError("not an arithmetic expression") from None
        return self._evaluate(tree.body)

    def _evaluate(self, node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return self._checked(node.value)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return self._checked(_UNARY[type(node.op)](self._evaluate(node.operand)))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = self._evaluate(node.left), self._evaluate(node.right)
            if isinstance(node.op, ast.Pow):
                self._check_power(left, right)
            try:
                return self._checked(_BINARY[type(node.op)](left, right))
            except ZeroDivisionError:
                raise CalculatorError("division by zero") from None
            except OverflowError:
                raise CalculatorError("result too large") from None
        raise CalculatorError(f"unsupported: {ast.unparse(node)[:40]!r} (numbers, + - * / // % "
                              "** and parentheses only)")

    def _check_power(self, base: int | float, exponent: int | float) -> None:
        if abs(exponent) > self.max_exponent:
            raise CalculatorError(f"exponent beyond {self.max_exponent}")
        if isinstance(base, int) and isinstance(exponent, int) and abs(base) > 1 and \
                exponent * math.log10(abs(base)) > self.max_digits:
            raise CalculatorError(f"result longer than {self.max_digits} digits")
        if base == 0 and exponent < 0:
            raise CalculatorError("division by zero")

    def _checked(self, value: int | float | complex) -> int | float:
        if isinstance(value, complex):  # a negative number to a fractional power
            raise CalculatorError("result is not a real number")
        if isinstance(value, float) and not math.isfinite(value):
            raise CalculatorError("result too large")
        if isinstance(value, int) and abs(value) >= 10 ** self.max_digits:
            raise CalculatorError(f"result longer than {self.max_digits} digits")
        return value


def format_number(value: int | float) -> str:
    """Integers as digits; an integral float as an integer too (`10/2` shows `5`, which the
    integer answers of the arithmetic tasks can copy); other floats by `repr`."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return repr(value) if isinstance(value, float) else str(value)


class CalculatorEnv(ToolEnv):
    """The model writes a call (`<calc>EXPR</calc>`, or `calc:EXPR#` with `TINY_SYNTAX`); the
    environment answers `<result>VALUE</result>`, or `<result>error: WHY</result>` as a failed
    call. A turn without a call is the final answer, scored by `reward_fn(text, answer)`."""

    tool_name = "calculator"
    syntaxes = {"tags": TAG_SYNTAX, "tiny": TINY_SYNTAX}

    def __init__(self, *, calculator: Calculator = Calculator(), **kwargs) -> None:
        super().__init__(**kwargs)
        self.calculator = calculator

    async def run_tool(self, argument: str) -> ToolResult:
        try:
            return ToolResult("success", format_number(self.calculator(argument)))
        except CalculatorError as exc:
            return ToolResult("failure", f"error: {exc}", error=str(exc))
