"""The command line: the click group (main), the options derived from Setup (options), the measuring commands
(measure), plots (plot, plots), doctor (doctor) and the rich tables (report). The only importer of click and rich;
nothing imports this package.
"""
