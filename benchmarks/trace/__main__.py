from benchmarks.trace.run import main

main()
