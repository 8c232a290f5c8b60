module github.com/deltagym/deltagym

go 1.26.8

require (
	github.com/containerd/cgroups/v3 v3.1.3 // indirect
	github.com/moby/sys/userns v0.1.0 // indirect
	golang.org/x/sys v0.50.0 // indirect
)
