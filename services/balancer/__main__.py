from deepinfer.balancer.service import main

main()
