from padim.cli import main

raise SystemExit(main())
