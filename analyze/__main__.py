import sys

from .cli import _guarded, analyze, keep_pandas_out_of_pyarrow

keep_pandas_out_of_pyarrow()  # as the `analyze` script does: pyarrow would import pandas (0.3 s) for nothing
_guarded(analyze, sys.argv[1:], prog_name="python -m steplens.analyze")
