from steplens.analyze.cli_rerun import catch_interrupts, exit_without_teardown

catch_interrupts()  # before the imports: a SIGTERM during them exits 130, as one later does


def _entry() -> None:
    import sys

    from .cli import _guarded, analyze, keep_pandas_out_of_pyarrow

    keep_pandas_out_of_pyarrow()  # as the `analyze` script does: pyarrow would import pandas (0.3 s) for nothing
    _guarded(analyze, sys.argv[1:], prog_name="python -m steplens.analyze")


exit_without_teardown(_entry)
