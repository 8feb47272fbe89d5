from deepinfer.tokenizer.service import main

main()
