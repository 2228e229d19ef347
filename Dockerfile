# For users with a container daemon; NOT what `make images` runs (that builds the same two
# images without a daemon, hack/images, and is the tested path). One Dockerfile, two targets:
#
#   docker build --target manager --build-arg VERSION=v0.1.0 -t ghcr.io/apportion/manager:v0.1.0 .
#   docker build --target agent   --build-arg VERSION=v0.1.0 -t ghcr.io/apportion/agent:v0.1.0 .
#
# distroless/static:nonroot carries what hack/images puts in its base layer: /etc/passwd with
# nonroot (65532), a CA bundle, /tmp.
FROM golang:1.27 AS build
ARG VERSION=dev
ARG TARGETARCH
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY api/ api/
COPY cmd/ cmd/
COPY internal/ internal/
RUN for b in manager agent; do \
      CGO_ENABLED=0 GOOS=linux GOARCH=${TARGETARCH} go build -trimpath \
        -ldflags "-s -w -X github.com/apportion/apportion/internal/version.Version=${VERSION}" \
        -o /out/$b ./cmd/$b || exit 1; \
    done

FROM gcr.io/distroless/static:nonroot AS manager
COPY --from=build /out/manager /manager
USER 65532:65532
ENTRYPOINT ["/manager"]

FROM gcr.io/distroless/static:nonroot AS agent
COPY --from=build /out/agent /agent
USER 65532:65532
ENTRYPOINT ["/agent"]
