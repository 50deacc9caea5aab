// Package storev1 holds the generated Go code for the store's wire schema,
// store.proto (protobuf package cudaipc.store.v1).
//
// The generated files are committed (store.pb.go here, and the Python
// client's python/cudaipc/_store_pb2.py, which a test keeps in sync) so that building needs no protoc. After
// editing store.proto, regenerate with protoc 3.21 or later and
// protoc-gen-go v1.36.12 on $PATH:
//
//	go install google.golang.org/protobuf/cmd/protoc-gen-go@v1.36.12
//	go generate ./protocol/storev1
package storev1

//go:generate protoc --go_out=. --go_opt=paths=source_relative store.proto
//go:generate go test -run ^TestPythonModuleInSync$ . -args -update-python
