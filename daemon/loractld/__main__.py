from loractld.main import main

main()
