from .cli import analyze

analyze(prog_name="python -m steplens.analyze")
