"""``python -m jaxcomm``: jaxcomm/_diagnosis.py. That command reports from inside the
package's import (jaxcomm/__init__.py), before the extension loads; this runs it
when the package was imported first (``runpy.run_module("jaxcomm")``)."""

from jaxcomm._diagnosis import main

raise SystemExit(main())
