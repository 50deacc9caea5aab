// Package storev1 holds the generated Go code for the store's wire schema,
// store.proto (protobuf package cudaipc.store.v1).
//
// The generated files are committed (store.pb.go here, and the Python
// client's python/cudaipc/_store_pb2.py, which a test keeps in sync) so
// that building needs no generator. After editing store.proto, regenerate
// with
//
//	go generate ./protocol/storev1
//
// which needs nothing but Go: it runs the module tool protocgen
// (internal/protocgen: github.com/bufbuild/protocompile in place of protoc,
// and protoc-gen-go's generator at the version go.mod pins), so the file's
// header says "protoc (unknown)". CI checks that the committed files are
// what go generate writes; do not regenerate with protoc.
package storev1

//go:generate go tool protocgen store.proto
//go:generate go test -run ^TestPythonModuleInSync$ . -args -update-python
