from deepinfer.vision.service import main

main()
