import sys

from .cli import _guarded, analyze

_guarded(analyze, sys.argv[1:], prog_name="python -m steplens.analyze")
