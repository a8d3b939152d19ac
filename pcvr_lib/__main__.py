from pcvr_lib.cli import main

raise SystemExit(main())
