from kvforge.cli import main

if __name__ == "__main__":  # spawned workers (vLLM's engine core) re-import this module
    main()
