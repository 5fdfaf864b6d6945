from specrouter.cli import main

raise SystemExit(main())
