"""The Python half of scripts/gpu_check.sh: `memagent.gpucheck.cli` (nbs/22_gpucheck_6_cli.ipynb),
whose commands are

    python scripts/gpu_check.py preset | layout | plan | subset | part NAME | render | compare ...
    (--help for each)

The parts of the one-GPU subset, their caps and what each checks are in memagent.gpucheck.parts
(nbs/22_gpucheck_3_parts.ipynb). memagent comes from this checkout through PYTHONPATH (gpu_check.sh
sets it) or from an installed package.
"""

from memagent.gpucheck.cli import main

if __name__ == '__main__':
    main()
