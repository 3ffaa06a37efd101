from controller.shell.main import main

raise SystemExit(main())
