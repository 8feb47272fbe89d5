from deepinfer.kvindex.service import main

main()
