from deepinfer.decode.service import main

main()
