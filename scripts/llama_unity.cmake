# Included after each project() of llama.cpp's build (CMAKE_PROJECT_INCLUDE, scripts/build_llama.sh).
# Unity builds for the code that is compiled for its structure, not its arithmetic:
# - llama-server's application code (the common library and the server's own targets): their
#   files each parse the same large headers (nlohmann/json, the chat and template code) and
#   instantiate the same templates again; in batches that work is done once a batch;
# - libmtmd's per-model graph builders (tools/mtmd/models/*.cpp), batched as llama.cpp batches
#   its own models (src/CMakeLists.txt: UNITY_BUILD, batch 16, the other sources left out).
# ggml, libllama and the rest of libmtmd are built as llama.cpp builds them.
if(CMAKE_VERSION VERSION_LESS 3.19)
  return()  # no deferred calls before CMake 3.19: a plain build
endif()
get_property(_lss_unity_deferred GLOBAL PROPERTY LSS_UNITY_DEFERRED)
if(_lss_unity_deferred)
  return()
endif()
set_property(GLOBAL PROPERTY LSS_UNITY_DEFERRED TRUE)

function(lss_unity_targets)
  foreach(t llama-common server-context llama-server-impl)
    if(TARGET ${t})
      set_target_properties(${t} PROPERTIES UNITY_BUILD ON)
    endif()
  endforeach()
  if(TARGET llama-common)
    # json.cpp defines JSON_ASSERT before it includes nlohmann/json: compiled alone, as
    # upstream, so that the definition holds in it and nowhere else
    get_target_property(dir llama-common SOURCE_DIR)
    set_source_files_properties("${dir}/json.cpp" TARGET_DIRECTORY llama-common
      PROPERTIES SKIP_UNITY_BUILD_INCLUSION ON)
  endif()
  if(TARGET mtmd)
    get_target_property(dir mtmd SOURCE_DIR)
    get_target_property(srcs mtmd SOURCES)
    set(others "")
    foreach(s IN LISTS srcs)
      if(NOT s MATCHES "(^|/)models/")
        if(NOT IS_ABSOLUTE "${s}")
          set(s "${dir}/${s}")
        endif()
        list(APPEND others "${s}")
      endif()
    endforeach()
    set_source_files_properties(${others} TARGET_DIRECTORY mtmd
      PROPERTIES SKIP_UNITY_BUILD_INCLUSION ON)
    set_target_properties(mtmd PROPERTIES UNITY_BUILD ON UNITY_BUILD_BATCH_SIZE 16)
  endif()
endfunction()

# Run once every directory is configured (the targets exist by then).
cmake_language(DEFER DIRECTORY "${CMAKE_SOURCE_DIR}" CALL lss_unity_targets)
