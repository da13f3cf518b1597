"""`python -m llmgw.cp._worker`: a router worker process of llmgw-cp (see _workers.py).

Its own module, so that `-m` does not run a module the package has already imported.
"""

import sys

from llmgw.cp._workers import main

sys.exit(main())
