from kvshelf.bench.trace.run import main

main()
