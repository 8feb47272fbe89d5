from deepinfer.prefill.service import main

main()
