"""Dataflow flex-template entry point: the launcher runs this file (FLEX_TEMPLATE_PYTHON_PY_FILE)
with the template's parameters and the pipeline options as flags. It lives outside the
`pipeline` package on purpose: a file run as a script puts its own directory first on
sys.path, and inside the package `pipeline/check/inspect.py` would shadow the standard library."""

from pipeline.flex_template import main

if __name__ == "__main__":
    main()
