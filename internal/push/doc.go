package push
