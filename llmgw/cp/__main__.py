import sys

from llmgw.cp import main

sys.exit(main())
