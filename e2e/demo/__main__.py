import sys

from loom.e2e.demo.runner import main

sys.exit(main())
